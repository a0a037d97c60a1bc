// a LangChain.js retriever with no model: the best k documents by the words
// they share with the query (the RAG test and bench/client_probes use it)
import { BaseRetriever } from '@langchain/core/retrievers';

export class KeywordRetriever extends BaseRetriever {
  lc_namespace = ['kvblend', 'keyword'];
  constructor(docs, k) {
    super();
    this.docs = docs;
    this.k = k;
  }
  async _getRelevantDocuments(query) {
    const words = new Set(query.toLowerCase().match(/[a-z]+/g));
    const score = (d) => d.pageContent.toLowerCase().match(/[a-z]+/g).filter((w) => words.has(w)).length;
    return [...this.docs].sort((a, b) => score(b) - score(a)).slice(0, this.k);
  }
}
