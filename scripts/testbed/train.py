#!/usr/bin/env python3
"""Train the testbed model: a small Qwen3-architecture transformer, from scratch,
on the testbed's synthetic RAG prompts, and write it as a GGUF that kvblend and
libllama load.

Prompts come from worlds.py beside this file (the testbed generator), laid out
exactly as `kvblend blend` lays them out (src/blend/rag_prompt.cpp): the system
text with BOS, each chunk as chunk + "\\n\\n" without BOS, then the query;
the target is the answer and a newline. Training is on full prefills only, so
naive concatenation of per-chunk caches is off the training distribution, as
for a real model. Tokens: the Llama 2 SPM vocabulary of the pinned llama.cpp
source (models/ggml-vocab-llama-spm.gguf), tokenized as libllama does (spm.py).

The model: Qwen3 (pre-norm, RMS norm, q/k RMS norm per head, NEOX RoPE, GQA,
SwiGLU, tied embeddings). Loss: the answer tokens, plus --lm-weight times the
next-token loss of the whole prompt.

  python3 scripts/testbed/train.py --out runs/tiny --minutes 3 --threads 1
  python3 scripts/testbed/train.py --out runs/tiny --resume ...   # go on from runs/tiny/ckpt.pt

Writes OUT/ckpt.pt (resumable), OUT/log.jsonl (the training curve), OUT/model.gguf
(--export-type f32|f16|q8_0) and OUT/eval.json (greedy exact match on dev.jsonl
for the full prefill and for naive concatenation, the answers of both).
Needs torch (>= 1.13; bf16 autocast and fused attention on CUDA with torch 2),
numpy and the pinned source's gguf-py (put on sys.path from --llama-dir).
"""
import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import worlds  # noqa: E402  (the testbed generator, beside this file)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run folder (checkpoint, log, GGUF, eval)")
    p.add_argument("--llama-dir", default=os.path.join(ROOT, "third_party", "llama.cpp"), help="pinned llama.cpp source (gguf-py, vocab)")
    p.add_argument("--vocab", default=None, help="vocab GGUF (default: LLAMA_DIR/models/ggml-vocab-llama-spm.gguf)")
    # model size
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--ctx", type=int, default=1024, help="context length written into the GGUF")
    # training
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decay to this share of --lr")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: until --minutes or --tokens)")
    p.add_argument("--tokens", type=float, default=0, help="stop after this many training tokens (e.g. 3e8)")
    p.add_argument("--minutes", type=float, default=0, help="stop after this much wall time")
    p.add_argument("--lm-weight", type=float, default=0.25, help="weight of the prompt's next-token loss")
    p.add_argument("--lm-frac", type=float, default=0.25, help="share of the prompt's positions with a next-token loss")
    p.add_argument("--questions", type=int, default=1,
                   help="questions trained per world: each question and its answer see the prompt and themselves "
                        "only, at the positions after the prompt (K separate examples sharing one prompt's compute)")
    p.add_argument("--min-people", type=int, default=3)
    p.add_argument("--max-people", type=int, default=6)
    p.add_argument("--curriculum", type=float, default=0.0,
                   help="share of the run over which the world size grows from 2 people to --max-people")
    p.add_argument("--level-up", type=float, default=0.0,
                   help="adaptive curriculum: worlds of 2 people first (--level-start), one more each time the mean answer loss "
                        "of a --log-every window falls below this (e.g. 0.3); at --max-people the range becomes "
                        "--min-people..--max-people (0: off; overrides --curriculum)")
    p.add_argument("--level-start", type=int, default=0,
                   help="--level-up's first world size (default 2, or the checkpoint's level; 1: worlds of one "
                        "person, where every question has one candidate answer in the text)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--workers", type=int, default=0, help="data worker processes (0: in the training loop)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (torch 2, CUDA)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--ckpt-every", type=float, default=5.0, help="minutes between checkpoints")
    p.add_argument("--eval-every", type=int, default=0, help="steps between dev evaluations (0: at the end only)")
    p.add_argument("--eval-n", type=int, default=400, help="dev prompts evaluated")
    p.add_argument("--dev", default=None, help="prompts (JSONL) to evaluate on (default: dev.jsonl beside this file)")
    p.add_argument("--export-type", default="f16", choices=["f32", "f16", "q8_0"], help="matrix type in the GGUF")
    p.add_argument("--export-only", action="store_true", help="load OUT/ckpt.pt, evaluate and export, no training")
    p.add_argument("--ref-n", type=int, default=8, help="dev prompts whose logits go into OUT/ref.json for tests")
    return p.parse_args(argv)


# --- data ----------------------------------------------------------------------

class Layout:
    """prompts as kvblend blend lays them out (rag_prompt_build without chat)."""

    def __init__(self, tok):
        self.tok = tok
        self.nl = tok.encode("\n")[-1]  # <0x0A>

    def context(self, ex):
        """the system chunk and the documents: token ids and the segment of each (0 the
        system chunk, 1.. the documents)"""
        ids = self.tok.encode(ex.get("system", ""), bos=True)
        seg = [0] * len(ids)
        for ci, c in enumerate(ex["chunks"]):
            t = self.tok.encode(c + "\n\n")
            ids += t
            seg += [ci + 1] * len(t)
        return ids, seg

    def prompt(self, ex):
        """token ids and the segment of each: 0 the system chunk, 1.. the documents, -1 the query."""
        ids, seg = self.context(ex)
        q = self.tok.encode(ex["query"])
        return ids + q, seg + [-1] * len(q)

    def answer(self, text):
        # generated after the query: the answer's words (a space before each,
        # as the tokenizer's space prefix gives) and the newline that ends it
        return self.tok.encode(text.strip() + "\n")


class Batches:
    """endless batches of training prompts, each [prompt, answer] right-padded."""

    def __init__(self, args, tok, seed, level=None):
        self.args, self.layout, self.level = args, Layout(tok), level
        self.rng = random.Random(seed)

    def people(self, progress):
        """the world sizes at this point of the run (progress in [0, 1]): with a
        curriculum, 2 people at first, growing to --max-people"""
        a = self.args
        if self.level is not None:  # --level-up: the level the training loop has reached
            n = self.level.value
            return (a.min_people, a.max_people) if n >= a.max_people else (max(1, n - 1), n)
        if a.curriculum <= 0:
            return a.min_people, a.max_people
        grow = min(1.0, progress / a.curriculum)
        hi = 2 + round(grow * (a.max_people - 2))
        return (a.min_people if grow >= 1 else 2), max(2, hi)

    def sample(self, lo, hi):
        """one world: the prompt's fields and --questions (kind, query, answer) triples;
        with --questions 1 the question worlds.make_prompt would ask, else a sample of
        every question about every person of the world"""
        rng = self.rng
        world = worlds.make_world(rng, rng.randint(lo, hi))
        ex = worlds.make_context(rng, world)
        if self.args.questions <= 1:
            qs = [rng.choice(worlds.questions_about(world, rng.choice(world.people)))]
        else:
            every = [q for p in world.people for q in worlds.questions_about(world, p)]
            qs = rng.sample(every, min(self.args.questions, len(every)))
        return ex, [(kind, worlds.query_text(q), " " + a) for kind, q, a in qs]

    def make(self, progress, pool=8):
        """the next batch; prompts are made `pool` batches at a time and grouped
        by length, so that little of a batch is padding"""
        if not getattr(self, "ready", None):
            lo, hi = self.people(progress)
            rows = []
            for _ in range(self.args.batch * pool):
                ex, qs = self.sample(lo, hi)
                ids, _ = self.layout.context(ex)
                blocks = [(self.layout.tok.encode(q), self.layout.answer(a)) for _, q, a in qs]
                rows.append((ids, blocks))
            rows.sort(key=lambda r: len(r[0]) + sum(len(q) + len(a) for q, a in r[1]))
            b = self.args.batch
            self.ready = [rows[i:i + b] for i in range(0, len(rows), b)]
            self.rng.shuffle(self.ready)
        return self.pad(self.ready.pop())

    def pad(self, rows):
        """x (ids), y (answer targets), ylm (prompt next-token targets), pos (positions) and
        blk (the block of each position: 0 the prompt, j > 0 the j-th question and its answer,
        -1 padding) of a batch; row r is [prompt, query 1, answer 1, query 2, …]"""
        import numpy as np
        T = max(len(ids) + sum(len(q) + len(a) for q, a in blocks) for ids, blocks in rows)
        T = (T + 15) // 16 * 16
        x = np.zeros((len(rows), T), dtype=np.int64)
        y = np.full((len(rows), T), -1, dtype=np.int64)
        ylm = np.full((len(rows), T), -1, dtype=np.int64)
        pos = np.tile(np.arange(T, dtype=np.int64), (len(rows), 1))
        blk = np.full((len(rows), T), -1, dtype=np.int64)
        for r, (ids, blocks) in enumerate(rows):
            n = len(ids)
            x[r, :n] = ids
            ylm[r, :n - 1] = ids[1:]
            blk[r, :n] = 0
            at = n
            for j, (q, ans) in enumerate(blocks):
                seq = q + ans
                x[r, at:at + len(seq)] = seq
                pos[r, at:at + len(seq)] = np.arange(n, n + len(seq))
                blk[r, at:at + len(seq)] = j + 1
                y[r, at + len(q) - 1:at + len(q) - 1 + len(ans)] = ans
                at += len(seq)
        return x, y, ylm, pos, blk


def run_progress(args, step, tokens_seen, elapsed_s):
    """how far the run is, in [0, 1], for the learning-rate schedule: by --steps,
    --tokens or --minutes (of this invocation), whichever is furthest. The tokens
    seen are counted, not estimated from the steps: a run resumed with a larger
    --tokens goes on from where its tokens put it on the new schedule."""
    p = [0.0]
    if args.steps:
        p.append(step / args.steps)
    if args.tokens:
        p.append(tokens_seen / args.tokens)
    if args.minutes:
        p.append(elapsed_s / (args.minutes * 60))
    return min(1.0, max(p))


def block_mask(blk, device):
    """attention of a packed row (Batches.pad): the prompt is causal; a question block
    sees the prompt and itself (causal); padding sees itself only. bool [B, 1, T, T]."""
    import torch
    b = torch.from_numpy(blk).to(device)
    T = b.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    qi, ki = b[:, :, None], b[:, None, :]
    m = ((ki == 0) & (qi >= 0)) | ((qi == ki) & (qi > 0))
    m = (m & causal) | torch.eye(T, dtype=torch.bool, device=device)
    return m[:, None]


def batch_iter(args, tok, total_steps, start_step, progress, level=None):
    """batches in this process (progress(): the run's progress), or from --workers
    processes (torch DataLoader), which estimate it from their batch count and total_steps."""
    import torch
    if args.workers <= 0:
        b = Batches(args, tok, args.seed * 1000003 + start_step, level)
        while True:
            yield b.make(progress())

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            b = Batches(args, tok, (args.seed * 1000003 + start_step) * 64 + wid, level)  # level: shared memory
            k = 0
            while True:
                yield b.make((start_step + k * nw + wid) / total_steps if total_steps > 0 else 1.0)
                k += 1

    dl = torch.utils.data.DataLoader(Stream(), batch_size=None, num_workers=args.workers, prefetch_factor=4,
                                     persistent_workers=True)
    for arrays in dl:
        yield tuple(a.numpy() for a in arrays)


# --- model ---------------------------------------------------------------------

def build_model(args, n_vocab):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    have_sdpa = hasattr(F, "scaled_dot_product_attention")

    class RMSNorm(nn.Module):
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def rope(x, cos, sin):
        # NEOX: the two halves of each head rotate together (ggml's rope mode 2, qwen3)
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d, hd = args.d_model, args.head_dim
            self.attn_norm = RMSNorm(d)
            self.q = nn.Linear(d, args.heads * hd, bias=False)
            self.k = nn.Linear(d, args.kv_heads * hd, bias=False)
            self.v = nn.Linear(d, args.kv_heads * hd, bias=False)
            self.o = nn.Linear(args.heads * hd, d, bias=False)
            self.q_norm = RMSNorm(hd)
            self.k_norm = RMSNorm(hd)
            self.ffn_norm = RMSNorm(d)
            self.gate = nn.Linear(d, args.ffn, bias=False)
            self.up = nn.Linear(d, args.ffn, bias=False)
            self.down = nn.Linear(args.ffn, d, bias=False)

        def forward(self, x, cos, sin, mask):
            B, T, _ = x.shape
            H, KV, hd = args.heads, args.kv_heads, args.head_dim
            h = self.attn_norm(x)
            q = self.q_norm(self.q(h).view(B, T, H, hd)).transpose(1, 2)    # [B, H, T, hd]
            k = self.k_norm(self.k(h).view(B, T, KV, hd)).transpose(1, 2)   # [B, KV, T, hd]
            v = self.v(h).view(B, T, KV, hd).transpose(1, 2)                # [B, KV, T, hd]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if KV != H:
                k = k.repeat_interleave(H // KV, dim=1)
                v = v.repeat_interleave(H // KV, dim=1)
            if have_sdpa:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            else:
                s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                if mask is None:
                    mask_ = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                else:
                    mask_ = mask
                s = s.masked_fill(~mask_, float("-inf"))
                a = torch.softmax(s.float(), dim=-1).type_as(q) @ v
            x = x + self.o(a.transpose(1, 2).reshape(B, T, H * hd))
            h = self.ffn_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(n_vocab, args.d_model)
            self.blocks = nn.ModuleList([Block() for _ in range(args.layers)])
            self.norm = RMSNorm(args.d_model)
            inv = 1.0 / (args.rope_base ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)
            for n, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * args.layers) if n.endswith(("o.weight", "down.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, mask=None, hidden=False, pos=None):
            """logits [B, T, n_vocab] (hidden: the final-normed states [B, T, d] instead);
            mask: None (causal) or bool [B, 1, T, T], True where attended; pos: None
            (0, 1, …) or the positions [B, T]."""
            T = idx.shape[1]
            if pos is None:
                t = torch.arange(T, device=idx.device).float()
                f = torch.outer(t, self.inv_freq)  # [T, head_dim / 2]
                cos, sin = f.cos()[None, None], f.sin()[None, None]
            else:
                f = pos.float()[:, :, None] * self.inv_freq  # [B, T, head_dim / 2]
                cos, sin = f.cos()[:, None], f.sin()[:, None]
            x = self.embed(idx)
            for b in self.blocks:
                x = b(x, cos, sin, mask)
            h = self.norm(x)
            return h if hidden else h @ self.embed.weight.t()

    return Model()


def flops_per_token(args, n_vocab, T):
    """training FLOPs per token: 6 x the matmul parameters a token runs (the output
    layer on the lm_frac share of positions that have a loss, and the answer's) +
    3 x the forward attention matmuls (QK^T and AV over half the T keys, causal)."""
    d, hd = args.d_model, args.head_dim
    per_layer = d * hd * (2 * args.heads + 2 * args.kv_heads) + 3 * d * args.ffn
    out_share = min(1.0, args.lm_frac + 3.0 / T) if args.lm_weight > 0 else 3.0 / T
    mat = args.layers * per_layer + out_share * d * n_vocab  # tied: the embedding matrix is the output layer
    attn = args.layers * 2 * 2 * args.heads * hd * T / 2
    return 6 * mat + 3 * attn


# --- evaluation ----------------------------------------------------------------

def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def naive_mask(segs, T, device):
    """naive concatenation as attention: a document token sees only its own chunk, the query (and answer) all."""
    import torch
    m = torch.zeros(len(segs), 1, T, T, dtype=torch.bool, device=device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    for r, seg in enumerate(segs):
        s = torch.tensor(seg + [-1] * (T - len(seg)), device=device)
        same = (s[:, None] == s[None, :]) | (s[:, None] == -1)
        m[r, 0] = same & causal
    return m


def greedy_answers(model, layout, exs, naive, device, max_new=8, bs=32):
    """greedy answers (text up to the first newline or period, trimmed), as kvblend bench accuracy cuts them."""
    import torch
    tok = layout.tok
    out = []
    for i in range(0, len(exs), bs):
        chunk = exs[i:i + bs]
        ps = [layout.prompt(e) for e in chunk]
        seqs = [list(ids) for ids, _ in ps]
        segs = [list(seg) for _, seg in ps]
        gen = [[] for _ in chunk]
        done = [False] * len(chunk)
        for _ in range(max_new):
            T = max(len(s) for s in seqs)
            x = torch.zeros(len(seqs), T, dtype=torch.long, device=device)
            for r, s in enumerate(seqs):
                x[r, :len(s)] = torch.tensor(s)
            mask = naive_mask(segs, T, device) if naive else None
            with torch.no_grad(), autocast(device):
                h = model(x, mask, hidden=True)
                last = torch.stack([h[r, len(s) - 1] for r, s in enumerate(seqs)])
                logits = (last @ model.embed.weight.t()).float()  # [B, n_vocab]: only the last rows
            for r, s in enumerate(seqs):
                if done[r]:
                    continue
                t = int(logits[r].argmax())
                gen[r].append(t)
                s.append(t)
                segs[r].append(-1)
                text = tok.decode(gen[r])
                if t == tok.eos or "\n" in text or "." in text:
                    done[r] = True
            if all(done):
                break
        for g in gen:
            text = tok.decode(g)
            for c in "\n.":
                text = text.split(c)[0]
            out.append(text.strip())
    return out


def evaluate(model, layout, dev, device):
    model.eval()
    res = {}
    for name, naive in (("full", False), ("naive", True)):
        ans = greedy_answers(model, layout, dev, naive, device)
        em = sum(a == e["answer"].strip() for a, e in zip(ans, dev)) / len(dev)
        kinds = {}
        for a, e in zip(ans, dev):
            k = kinds.setdefault(e.get("kind", "?"), [0, 0])
            k[0] += a == e["answer"].strip()
            k[1] += 1
        res[name] = {"exact_match": em, "by_kind": {k: v[0] / v[1] for k, v in sorted(kinds.items())}, "answers": ans}
    model.train()
    return res


class autocast:
    """bf16 autocast on CUDA, nothing on the CPU."""

    def __init__(self, device):
        import torch
        self.ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None

    def __enter__(self):
        if self.ctx:
            self.ctx.__enter__()

    def __exit__(self, *a):
        if self.ctx:
            self.ctx.__exit__(*a)


# --- GGUF export ---------------------------------------------------------------

def export_gguf(model, args, vocab_path, path, wtype):
    """the model as a qwen3 GGUF, tensors named as libllama names them, the tokenizer copied from vocab_path."""
    import numpy as np
    import gguf
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_name("kvblend testbed")
    w.add_context_length(args.ctx)
    w.add_embedding_length(args.d_model)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[wtype])
    # the tokenizer, as the vocab GGUF has it
    r = gguf.GGUFReader(vocab_path)
    for k, f in r.fields.items():
        if not k.startswith("tokenizer."):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), vt, sub_type=f.types[1])
        else:
            w.add_key_value(k, f.contents(), vt)
    n_vocab = sd["embed.weight"].shape[0]
    w.add_vocab_size(n_vocab)

    def mat(name, a):
        if wtype == "f32":
            w.add_tensor(name, a.astype(np.float32))
        elif wtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vec(name, a):
        w.add_tensor(name, a.astype(np.float32))

    mat("token_embd.weight", sd["embed.weight"])  # [n_vocab, d] rows: ggml [d, n_vocab]
    vec("output_norm.weight", sd["norm.weight"])
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
             "down": "ffn_down"}
    for il in range(args.layers):
        p = f"blocks.{il}."
        vec(f"blk.{il}.attn_norm.weight", sd[p + "attn_norm.weight"])
        vec(f"blk.{il}.ffn_norm.weight", sd[p + "ffn_norm.weight"])
        vec(f"blk.{il}.attn_q_norm.weight", sd[p + "q_norm.weight"])
        vec(f"blk.{il}.attn_k_norm.weight", sd[p + "k_norm.weight"])
        for ours, theirs in names.items():
            mat(f"blk.{il}.{theirs}.weight", sd[p + ours + ".weight"])  # torch [out, in]: ggml [in, out]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_ref(model, layout, dev, device, path, n):
    """tokens and last-token logits (f32, CPU) of n dev prompts: what tests compare the GGUF with."""
    import torch
    out = []
    model_cpu = model
    with torch.no_grad():
        for e in dev[:n]:
            ids, _ = layout.prompt(e)
            x = torch.tensor([ids], device=device)
            logits = model_cpu(x)[0, -1].float().cpu()
            out.append({"system": e.get("system", ""), "chunks": e["chunks"], "query": e["query"], "tokens": ids,
                        "logits": [round(float(v), 5) for v in logits]})
    with open(path, "w") as f:
        json.dump(out, f)


# --- main ----------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    if not (args.steps or args.tokens or args.minutes or args.export_only):
        raise SystemExit("train.py: give the run a length: --steps, --tokens or --minutes")
    sys.path.insert(0, os.path.join(args.llama_dir, "gguf-py"))
    sys.path.insert(0, HERE)
    import numpy as np
    import torch
    from spm import Spm

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    vocab_path = args.vocab or os.path.join(args.llama_dir, "models", "ggml-vocab-llama-spm.gguf")
    tok = Spm(vocab_path)
    layout = Layout(tok)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    log_path = os.path.join(args.out, "log.jsonl")
    dev = read_jsonl(args.dev or os.path.join(HERE, "dev.jsonl"))[: args.eval_n]

    torch.manual_seed(args.seed)
    state = None
    if args.resume or args.export_only:
        state = torch.load(ckpt_path, map_location="cpu")
        saved = state["args"]
        for k in ("d_model", "layers", "heads", "kv_heads", "head_dim", "ffn", "rope_base"):
            setattr(args, k, saved[k])  # the checkpoint's shape wins
    model = build_model(args, len(tok)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}]
    try:  # one fused kernel for the update on CUDA (torch 2)
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, tokens_seen, wall = 0, 0, 0.0
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens_seen, wall = state["step"], state["tokens"], state["wall"]
    import multiprocessing
    # --level-up: the world size reached, shared with --workers processes (forked)
    start = args.level_start or ((state.get("level") or 2) if state else 2)
    level = multiprocessing.Value("i", start) if args.level_up > 0 else None

    # the run's length in steps, for the schedule: --steps, or estimated from --tokens
    mean_tokens = (175 + 17 * max(0, args.questions - 1)) * args.batch  # ~175 tokens per prompt at 3-6 people, ~17 per question
    total = args.steps or (int(args.tokens / mean_tokens) if args.tokens else 0)
    fpt = flops_per_token(args, len(tok), 200)
    print(f"model: {n_params / 1e6:.2f}M parameters ({(n_params - len(tok) * args.d_model) / 1e6:.2f}M outside the "
          f"embedding), {fpt / 1e6:.1f} MFLOP per training token; device {device}, {args.threads} threads", flush=True)

    run = {"t0": time.time(), "wall0": wall}

    def progress():
        return run_progress(args, step, tokens_seen, time.time() - run["t0"])

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        p = progress()
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))

    def save():
        tmp = ckpt_path + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens": tokens_seen,
                    "wall": wall, "args": vars(args), "level": level.value if level else None}, tmp)
        os.replace(tmp, ckpt_path)

    fwd = torch.compile(model) if args.compile else model
    stop = {"signal": None}

    def on_signal(signum, frame):  # SIGTERM / SIGINT: finish the step, save, evaluate, export
        stop["signal"] = signum

    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if not args.export_only:
        it = batch_iter(args, tok, total, step, progress, level)
        t_start = run["t0"] = time.time()
        wall0 = wall
        last_ckpt = t_start
        last_log = 0.0
        acc = {"loss": 0.0, "ans": 0.0, "lm": 0.0, "n": 0, "tok": 0}
        logf = open(log_path, "a")
        model.train()
        while True:
            elapsed = time.time() - t_start
            wall = wall0 + elapsed
            if args.steps and step >= args.steps:
                break
            if args.tokens and tokens_seen >= args.tokens:
                break
            if args.minutes and elapsed >= args.minutes * 60:
                break
            if stop["signal"] is not None:
                print(f"signal {stop['signal']}: stopping at step {step}", flush=True)
                break
            x, y, ylm, pos, blk = next(it)
            n_tok = int((x != 0).sum())  # real tokens (id 0, <unk>, pads)
            if args.questions > 1:
                mask, pos = block_mask(blk, device), torch.from_numpy(pos).to(device, non_blocking=True)
            else:
                mask, pos = None, None  # one question: the plain causal prompt
            x = torch.from_numpy(x).to(device, non_blocking=True)
            y = torch.from_numpy(y).to(device, non_blocking=True)
            ylm = torch.from_numpy(ylm).to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            # the output layer runs only on the rows that have a loss: the answer's,
            # and --lm-frac of the prompt's (the 32000-wide softmax dominates otherwise)
            with autocast(device):
                h = fwd(x, mask, True, pos).reshape(-1, args.d_model)
                ya, yl = y.view(-1), ylm.view(-1)
                ia = (ya >= 0).nonzero().squeeze(1)
                il = ((yl >= 0) & (torch.rand(yl.shape, device=device) < args.lm_frac)).nonzero().squeeze(1)
                la_logits = h[ia] @ model.embed.weight.t()
                ll_logits = h[il] @ model.embed.weight.t() if args.lm_weight > 0 and len(il) else None
            la = torch.nn.functional.cross_entropy(la_logits.float(), ya[ia])
            loss = la
            if ll_logits is not None:
                ll = torch.nn.functional.cross_entropy(ll_logits.float(), yl[il])
                loss = la + args.lm_weight * ll
            else:
                ll = torch.zeros((), device=device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += n_tok
            acc["loss"] += loss.detach()  # summed on the device: no sync per step
            acc["ans"] += la.detach()
            acc["lm"] += ll.detach()
            acc["n"] += 1
            acc["tok"] += n_tok
            if step % args.log_every == 0:
                el = time.time() - t_start
                rec = {"step": step, "tokens": tokens_seen, "wall_s": round(wall0 + el, 1), "lr": lr_at(step),
                       "loss": float(acc["loss"]) / acc["n"], "answer_loss": float(acc["ans"]) / acc["n"],
                       "lm_loss": float(acc["lm"]) / acc["n"],
                       "tok_per_s": round(acc["tok"] / max(1e-9, el - last_log))}
                last_log = el
                if level is not None:
                    rec["people"] = level.value
                    if rec["answer_loss"] < args.level_up and level.value < args.max_people:
                        level.value += 1  # batches made from now on have one more person
                print(json.dumps(rec), flush=True)
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                acc = {"loss": 0.0, "ans": 0.0, "lm": 0.0, "n": 0, "tok": 0}
            if args.eval_every and step % args.eval_every == 0:
                r = evaluate(model, layout, dev[:100], device)
                rec = {"step": step, "tokens": tokens_seen, "eval_n": len(dev[:100]), "full_em": r["full"]["exact_match"],
                       "naive_em": r["naive"]["exact_match"], "full_by_kind": r["full"]["by_kind"]}
                print(json.dumps(rec), flush=True)
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
            if time.time() - last_ckpt >= args.ckpt_every * 60:
                save()
                last_ckpt = time.time()
        wall = wall0 + (time.time() - t_start)
        save()
        run_s = time.time() - t_start
        summary = {"step": step, "tokens": tokens_seen, "wall_s": round(wall, 1),
                   "run_tok_per_s": round((tokens_seen - (state["tokens"] if state else 0)) / max(run_s, 1e-9)),
                   "flop_per_token": fpt}
        print(json.dumps(summary), flush=True)
        logf.write(json.dumps(summary) + "\n")
        logf.close()

    res = evaluate(model, layout, dev, device)
    res["n"] = len(dev)
    res["step"], res["tokens"] = step, tokens_seen
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(res, f)
    print(json.dumps({"eval_n": len(dev), "full_em": res["full"]["exact_match"], "naive_em": res["naive"]["exact_match"],
                      "full_by_kind": res["full"]["by_kind"]}), flush=True)
    model.eval()
    gguf_path = os.path.join(args.out, "model.gguf")
    export_gguf(model, args, vocab_path, gguf_path, args.export_type)
    write_ref(model, layout, dev, device, os.path.join(args.out, "ref.json"), args.ref_n)
    print(f"wrote {gguf_path} ({os.path.getsize(gguf_path) / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
