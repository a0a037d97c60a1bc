"""The SentencePiece (SPM) tokenizer of a llama.cpp vocab GGUF, as libllama runs it.

libllama (LLAMA_VOCAB_TYPE_SPM): a space is put before the text (add_space_prefix),
spaces become U+2581, then adjacent symbols are merged best score first (ties:
the leftmost pair) while the merged text is a token; what is left unmatched is
written as byte tokens <0xNN>. No vocab token has U+2581 after another
character, so no merge crosses a word boundary: words are tokenized alone and
memoized, which gives the same ids (checked at load).

Only what the testbed needs: plain text, no special-token parsing.
"""
import heapq

import gguf

SPACE = "\u2581"


class Spm:
    def __init__(self, vocab_gguf):
        r = gguf.GGUFReader(vocab_gguf)
        f = r.fields
        if f["tokenizer.ggml.model"].contents() != "llama":
            raise SystemExit(f"{vocab_gguf}: not an SPM (llama) vocabulary")
        self.tokens = f["tokenizer.ggml.tokens"].contents()
        self.scores = f["tokenizer.ggml.scores"].contents()
        self.bos = int(f["tokenizer.ggml.bos_token_id"].contents())
        self.eos = int(f["tokenizer.ggml.eos_token_id"].contents())
        asp = f.get("tokenizer.ggml.add_space_prefix")
        self.add_space_prefix = True if asp is None else bool(asp.contents())
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.byte_id = [self.ids[f"<0x{b:02X}>"] for b in range(256)]
        for t in self.tokens:
            s = t.lstrip(SPACE)
            if SPACE in s:
                raise SystemExit(f"{vocab_gguf}: token {t!r} joins words; the word-wise tokenizer does not apply")
        self.memo = {}

    def __len__(self):
        return len(self.tokens)

    def _spm(self, text):
        # symbols as a linked list over utf-8 characters (python str: code points)
        sym = list(text)
        n = len(sym)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []

        def add(left, right):
            if left < 0 or right < 0:
                return
            t = sym[left] + sym[right]
            i = self.ids.get(t)
            if i is None:
                return
            heapq.heappush(heap, (-self.scores[i], left, t))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, t = heapq.heappop(heap)
            right = nxt[left]
            if sym[left] == "" or right < 0 or sym[left] + sym[right] != t:
                continue  # a side changed since this pair was queued
            sym[left] = t
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        out = []
        i = 0
        while i >= 0 and i < n:
            s = sym[i]
            tid = self.ids.get(s)
            if tid is not None:
                out.append(tid)
            else:
                # libllama walks back through the merges; with score-first merging
                # an unmatched symbol is a single character: its bytes
                out.extend(self.byte_id[b] for b in s.encode("utf-8"))
            i = nxt[i]
        return out

    def encode(self, text, bos=False):
        """ids of text as libllama's tokenize(text, add_special=bos) gives them."""
        out = [self.bos] if bos else []
        if self.add_space_prefix:
            text = " " + text
        if not text:
            return out
        s = text.replace(" ", SPACE)
        # words: a run of U+2581 and the characters up to the next U+2581 after a non-space
        start = 0
        for i in range(1, len(s) + 1):
            if i == len(s) or (s[i] == SPACE and s[i - 1] != SPACE):
                w = s[start:i]
                ids = self.memo.get(w)
                if ids is None:
                    ids = self.memo[w] = self._spm(w)
                out.extend(ids)
                start = i
        return out

    def piece(self, tid):
        t = self.tokens[tid]
        if t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            return bytes([int(t[3:5], 16)])
        if tid in (self.bos, self.eos):
            return b""
        return t.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids):
        return b"".join(self.piece(i) for i in ids).decode("utf-8", errors="replace")
