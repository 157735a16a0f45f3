"""Benchmark and closing-note table for ``fxdebug.align``.

    OMP_NUM_THREADS=1 python tools/bench_align.py [--repeats 5]

1. Time to align the tiny LLaMA pair (Hugging Face's LlamaForCausalLM, 2 layers, hidden 32, 4 heads,
   2 kv heads, vocab 100, batch 2 x 8 tokens, against the hand-written one in tests/align_models.py):
   wall seconds of the whole ``fxdebug.align`` call (both runs, matching, first divergence), median
   of ``--repeats`` and the spread (min–max), for the SDPA and the eager reference; also the two
   recordings alone, to show what the matching costs.
2. Each planted bug (LLaMA and ResNet pairs) and what ``align`` named: the candidate op and module,
   the reference op and module, the relative error there, and whether the module is the right one.
3. ``--larger``: how it scales — Hugging Face's LLaMA with eager attention against the same weights
   with SDPA at hidden 512, 4 layers, 8 heads, 4 kv heads, vocab 1000, 2 x 64 tokens (one run each).
Prints markdown tables (pasted into docs/numerics.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fxdebug  # noqa: E402
from align_models import LLAMA_BUGS, RESNET_BUGS, Autocast, llama_pair, resnet_pair  # noqa: E402
from fxdebug.numerics.align_record import record  # noqa: E402


def _times(fn, repeats: int) -> list[float]:
    fn()  # warm up (imports, first-call dispatch caches)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts):.3f} s ({min(ts):.3f}–{max(ts):.3f})"


def timing(repeats: int) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    print("\n| pair | align (median, min–max) | the two recordings alone |\n|---|---|---|")
    for attn in ("sdpa", "eager"):
        ref, cand, ids = llama_pair(attn=attn)
        full = _times(lambda: fxdebug.align(ref, cand, (ids,)), repeats)
        rec = _times(lambda: (record(ref, (ids,)), record(cand, (ids,))), repeats)
        print(f"| tiny LLaMA, HF {attn} vs hand-written, exact | {_fmt(full)} | {_fmt(rec)} |")
    ref, cand, ids = llama_pair(LLAMA_BUGS["causal mask off by one"][0])
    print(f"| tiny LLaMA, HF sdpa vs hand-written, mask bug | "
          f"{_fmt(_times(lambda: fxdebug.align(ref, cand, (ids,)), repeats))} | |")
    ref, cand, ids = llama_pair()
    print(f"| tiny LLaMA, fp32 vs bf16 autocast | "
          f"{_fmt(_times(lambda: fxdebug.align(ref, Autocast(cand), (ids,)), repeats))} | |")


def bugs() -> None:
    print("\n| planted bug | reference | align named (candidate) | align named (reference) | error | right module |")
    print("|---|---|---|---|---|---|")
    cases = [(name, attn, lambda b=bug, a=attn: llama_pair(b, attn=a), cm, rm)
             for name, (bug, cm, rm) in LLAMA_BUGS.items() for attn in ("sdpa", "eager")]
    cases += [(name, "torchvision-style", lambda b=bugs_: resnet_pair(b), cm, rm)
              for name, (bugs_, cm, rm) in RESNET_BUGS.items()]
    for name, kind, make, cm, rm in cases:
        ref, cand, x = make()
        d = fxdebug.align(ref, cand, (x,)).first_divergent
        if d is None:
            print(f"| {name} | {kind} | nothing | nothing | | no |")
            continue
        ok = d.candidate[1].startswith(cm) and str(d.reference[1]).startswith(rm)
        print(f"| {name} | {kind} | `{d.candidate[0]}` in `{d.candidate[1]}` | `{d.reference[0]}` in "
              f"`{d.reference[1]}` | {d.error:.3g} | {'yes' if ok else 'NO'} |")
    print("\n| exact pair / dtype only | first_divergent |\n|---|---|")
    for label, make in (("LLaMA, HF sdpa vs hand-written", lambda: llama_pair()),
                        ("LLaMA, HF eager vs hand-written", lambda: llama_pair(attn="eager")),
                        ("ResNet, torchvision-style vs hand-written", lambda: resnet_pair())):
        ref, cand, x = make()
        print(f"| {label}, fp32 | {fxdebug.align(ref, cand, (x,)).first_divergent} |")
        print(f"| {label}, candidate in bf16 autocast | {fxdebug.align(ref, Autocast(cand), (x,)).first_divergent} |")


def larger() -> None:
    import copy

    import transformers

    from align_models import Logits

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                   use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(cfg).eval()
    cfg_sdpa = copy.deepcopy(cfg)
    cfg_sdpa._attn_implementation = "sdpa"
    sdpa = transformers.LlamaForCausalLM(cfg_sdpa).eval()
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    print("\n| larger pair (hidden 512, 4 layers, 2 x 64 tokens) | align (one run) | first_divergent |\n|---|---|---|")
    for label, ref, cand in (("HF eager vs HF sdpa, fp32", eager, sdpa),
                             ("HF eager fp32 vs HF sdpa in bf16 autocast", Logits(eager), Autocast(Logits(sdpa)))):
        t0 = time.perf_counter()
        al = fxdebug.align(ref, cand, (ids,))
        print(f"| {label} | {time.perf_counter() - t0:.1f} s | {al.first_divergent} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--larger", action="store_true", help="also time a hidden-512, 4-layer pair")
    args = parser.parse_args()
    timing(args.repeats)
    bugs()
    if args.larger:
        larger()


if __name__ == "__main__":
    main()
