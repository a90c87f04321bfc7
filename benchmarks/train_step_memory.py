"""Per-chip temporaries of the train step and the π_old log-prob pass against response length,
compiled for a TPU topology: the HBM that `tools.aot` reports and the on-chip VMEM it does not.

XLA:TPU's memory-space assignment places temporaries in VMEM (on-chip, ~100 MB per v6e chip
in these programs) before HBM; `memory_analysis().temp_size_in_bytes`, what tools.aot prints,
counts only what spills to HBM. At short lengths VMEM holds a large part of the temporaries, so
the HBM figure alone grows faster than the sequence (5.3x from 4k to 16k tokens here) even when
every temporary is linear in the length. This prints both, their sum, and the HBM growth per
1,024 tokens between consecutive lengths, which stays flat when nothing is quadratic
(docs/tpu.md section 4).

Default model: 2 layers of width 512 (8 heads of 64, MLP 1536), vocabulary 32,768, bf16
compute, full remat, splash attention; 4 responses of `prompt + length` tokens, one per chip
of v6e:2x2 (fsdp 4), one micro-batch. VMEM is read from XLA's buffer assignment, dumped to a
temporary directory (`--xla_dump_to`). Needs libtpu importable (docs/tpu.md); nothing runs.

    PYTHONPATH=.libtpu python benchmarks/train_step_memory.py --lengths 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import atexit
import glob
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

_DUMP = tempfile.mkdtemp(prefix="train_step_memory_")
atexit.register(shutil.rmtree, _DUMP, ignore_errors=True)  # unless --keep-dumps
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={_DUMP}", "--xla_dump_hlo_as_text"]
)

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from configs import default
from gspo_jax.config import specs
from tools import aot

aot.prepare_process()  # libtpu compiles only; jax's runtime stays on the CPU

GiB = 2**30
# "allocation 573: size 100595712, color 1, preallocated-temp:": memory space 1 is VMEM.
_VMEM = re.compile(r"^allocation \d+: size (\d+), color 1, preallocated-temp", re.MULTILINE)


def run_config(args, response_length: int):
    """configs/default.py at the benchmark's widths, batch and length."""
    c = default.get_config()
    m = c.model
    m.hidden_size, m.intermediate_size, m.num_layers = args.hidden, args.mlp, args.layers
    m.num_heads, m.num_kv_heads, m.head_dim = args.heads, args.heads, args.head_dim
    m.attention_impl, m.dtype, m.remat = args.attention, args.dtype, args.remat
    c.rollout_batch_size, c.num_return_sequences_in_group = 1, args.responses
    c.num_mini_batches, c.micro_batch_size = 1, args.responses
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.prompt_length, c.sampling.prompt_buckets = args.prompt, (args.prompt,)
    c.response_length, c.eval.batch_size = response_length, args.responses
    cfg = specs.scratch_model_config(c, vocab_size=args.vocab, eos_token_ids=(1,), pad_token_id=0)
    return c, cfg


def _vmem_of_new_dumps(before: set[str]) -> int:
    """VMEM temporaries of the largest program compiled since `before` (its buffer assignment)."""
    new = set(glob.glob(os.path.join(_DUMP, "*after_optimizations-buffer-assignment.txt")))
    sizes = [0]
    for path in new - before:
        text = Path(path).read_text()
        sizes.append(sum(int(s) for s in _VMEM.findall(text)) if len(text) > 1000 else 0)
    return max(sizes)


def compile_temps(a, function: str) -> tuple[int, int]:
    """(HBM temporaries, VMEM temporaries) per chip of one function, compiled as tools.aot
    compiles it."""
    before = set(glob.glob(os.path.join(_DUMP, "*after_optimizations-buffer-assignment.txt")))
    compile_fn = aot._compile_logprobs if function == "logprobs" else aot._compile_train_step
    report = compile_fn(a)
    return int(report.temp), _vmem_of_new_dumps(before)


def measure(args) -> list[dict]:
    devices = aot.topology_devices(args.topology)
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        c, cfg = run_config(args, T)
        a = aot._abstract_run(c, cfg, devices, num_processes=1)
        with jax.set_mesh(a.mesh):
            for function in args.functions.split(","):
                hbm, vmem = compile_temps(a, function)
                rows.append({"function": function, "T": T, "L": a.L, "hbm": hbm, "vmem": vmem})
                print(
                    f"  {function} T={T}: HBM {hbm / GiB:.3f} GiB, VMEM {vmem / GiB:.3f}",
                    flush=True,
                )
    return rows


def table(rows: list[dict]) -> str:
    out = [
        (
            "| function | response | L | HBM temp GiB | VMEM GiB | HBM + VMEM GiB "
            "| HBM growth MiB per 1k tokens since the row above |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    previous: dict[str, dict] = {}
    for r in rows:
        p = previous.get(r["function"])
        slope = (
            "" if p is None else f"{(r['hbm'] - p['hbm']) / (r['L'] - p['L']) * 1024 / 2**20:.1f}"
        )
        cells = [r["function"], f"{r['T']:,}", f"{r['L']:,}", f"{r['hbm'] / GiB:.3f}"]
        cells += [f"{r['vmem'] / GiB:.3f}", f"{(r['hbm'] + r['vmem']) / GiB:.3f}", slope]
        out.append("| " + " | ".join(cells) + " |")
        previous[r["function"]] = r
    for function in dict.fromkeys(r["function"] for r in rows):
        mine = [r for r in rows if r["function"] == function]
        first, last = mine[0], mine[-1]
        if len(mine) > 1 and first["hbm"]:
            both = (last["hbm"] + last["vmem"]) / (first["hbm"] + first["vmem"])
            out.append(
                f"{function}: {last['T'] / first['T']:.0f}x the response length, HBM temp "
                f"{last['hbm'] / first['hbm']:.2f}x, HBM + VMEM {both:.2f}x"
            )
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v6e:2x2")
    p.add_argument("--lengths", default="4096,8192,16384", help="response lengths")
    p.add_argument("--functions", default="train_step,logprobs")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--mlp", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="full")
    p.add_argument("--attention", default="splash")
    p.add_argument("--keep-dumps", action="store_true", help="keep XLA's dumps (buffer assignment)")
    args = p.parse_args()
    if args.keep_dumps:
        atexit.unregister(shutil.rmtree)
    print(
        f"{args.topology}: {args.layers} layers, d={args.hidden}, {args.heads} heads x "
        f"{args.head_dim}, MLP {args.mlp}, vocab {args.vocab}, {args.dtype}, remat "
        f"{args.remat}, {args.attention}; {args.responses} responses of {args.prompt} + T "
        f"tokens (XLA dumps in {_DUMP})",
        flush=True,
    )
    print(table(measure(args)))


if __name__ == "__main__":
    main()
