#!/usr/bin/env python3
"""Check a trained testbed run (scripts/testbed/train.py --out RUN) against kvblend and libllama.

1. tests/graph/test_testbed_export.cpp with RUN/model.gguf and RUN/ref.json: the
   prompts tokenize to the trainer's ids in libllama, and the last-token logits
   of our forward, libllama's and the PyTorch model's agree.
2. `kvblend bench accuracy` on the first --n dev prompts (full, naive and the
   default blend at --ratios): its full-prefill and naive answers next to the
   ones the trainer's own evaluation gave (RUN/eval.json), prompt by prompt.

  python3 scripts/testbed/check_export.py RUN [--n 100] [--build build]

Exit status 1 when the test fails or fewer than --min-agree of the answers agree
(kvblend runs an f16 KV cache and f16 weights, the trainer f32: a near-tie can flip).
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--n", type=int, default=100, help="dev prompts for the answer comparison")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--dev", default=os.path.join(ROOT, "scripts", "testbed", "dev.jsonl"), help="prompts (JSONL)")
    p.add_argument("--ratios", default="0.15")
    p.add_argument("--min-agree", type=float, default=0.97)
    p.add_argument("--tol", default=None, help="logit tolerance to torch (KVBLEND_TESTBED_TOL; default the test's)")
    a = p.parse_args()
    gguf, ref, ev = (os.path.join(a.run, f) for f in ("model.gguf", "ref.json", "eval.json"))
    for f in (gguf, ref, ev):
        if not os.path.exists(f):
            sys.exit(f"check_export: {f} is missing (train.py writes it)")

    env = dict(os.environ, KVBLEND_TESTBED_MODEL=gguf, KVBLEND_TESTBED_REF=ref)
    if a.tol:
        env["KVBLEND_TESTBED_TOL"] = a.tol
    t = subprocess.run([os.path.join(a.build, "bin", "kvblend_tests"), "--gtest_filter=testbed_export.*"], env=env)
    ok = t.returncode == 0

    out = os.path.join(a.run, "bench_accuracy.json")
    cmd = [os.path.join(a.build, "bin", "kvblend"), "bench", "accuracy", "-m", gguf, "--prompts",
           a.dev, "--n", str(a.n), "--ratios", a.ratios, "--json", out]
    print("+", " ".join(cmd), flush=True)
    b = subprocess.run(cmd)
    if b.returncode != 0:
        sys.exit(1)
    bench = {r["variant"]: r for r in json.load(open(out))["rows"] if r["variant"] in ("full", "naive")}
    train_eval = json.load(open(ev))
    for name in ("full", "naive"):
        ours = bench[name]["answers"]
        theirs = train_eval[name]["answers"][: len(ours)]
        same = sum(x == y for x, y in zip(ours, theirs)) / len(ours)
        em_ours = bench[name]["exact_match"]
        gold = [g for g in json.load(open(out))["gold"]]
        em_torch = sum(x == g for x, g in zip(theirs, gold)) / len(ours)
        print(f"{name}: answers equal to the trainer's {same:.3f} ({len(ours)} prompts); exact match kvblend "
              f"{em_ours:.3f}, trainer {em_torch:.3f}")
        ok &= same >= a.min_agree
    print("check_export:", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
