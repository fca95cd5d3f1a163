"""Plain decoding (γ=0) layout by layout against HF's anchors, in one process.

    python -m specserve.bench.plain [--layouts graph:mask,fused-graph:mask,fused-graph:flex]
        [--batches 1,16] [--out bench-results/plain.json]
    python -m specserve.bench.plain --tiny      # a CPU rehearsal (eager layouts)
    python -m specserve.bench.plain --profile   # then each layout and the compiled anchor under the profiler

Issue 31's first two figures (the engine at γ=0, batch 1 and 16, against HF's StaticCache loop
under `torch.compile`) for several ways of running the target at once. One random target (7B shapes
by default, bf16), one prompt set and one measurement of the anchors per batch serve every layout:
a minute or two of GPU time per layout instead of a whole `bench gpu` run each. A layout is
`execution:attention[:kv block size]` (ModelRunner's modes; a block size pages the cache, one pool
sized for the batch).

Per batch: every layout's engine is built and its graphs captured (the seconds that took, fused
blocks' compiles included), each is warmed on the prompts, then all are timed in interleaved
rounds (median); then the anchors (the compiled StaticCache loop and the bandwidth limit; HF's
eager generate() is `bench gpu`'s). A layout that fails to build or capture is reported as such
and the others go on. Each row: tok/s, its ratio to the compiled anchor and to the
bandwidth limit, the capture seconds, and whether its tokens equal the first layout's that ran (greedy
on a target whose choices are made robust to kernel noise). Prints a table and writes JSON.

With --profile, each layout and the compiled StaticCache anchor run once more under torch.profiler
(after all timing): per decode step, the wall, the device's kernel time, the kernels launched and
the share of the wall the device was busy; the op tables go beside --out. That says where a
layout's gap to the anchor is: more kernels or slower ones (busy near 1), or host time between
steps (busy well below 1).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench.gpu import (
    SHAPES, Config, Layout, build_engine, generate, measure_anchors, measure_configs, profile_run, prompt_sets,
    random_llama, release_memory, to_run,
)

STATIC = "HF StaticCache"  # the anchors' names begin so (bench/gpu.py measure_anchors)
LIMIT = "bandwidth limit"


def parse_layouts(text: str) -> list[Layout]:
    """"graph:mask,fused-graph:flex:16" -> Layouts (attention defaults to auto, the cache to dense)."""
    layouts = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) > 3:
            raise ValueError(f"a layout is execution:attention[:block size], got {item!r}")
        block = int(parts[2]) if len(parts) == 3 else None
        layouts.append(Layout(parts[0], parts[1] if len(parts) > 1 else "auto", block))
    if len({label(layout) for layout in layouts}) < len(layouts):
        raise ValueError(f"a layout is named twice in {text!r}")
    return layouts


def label(layout: Layout) -> str:
    paged = f", paged {layout.kv_block_size}" if layout.kv_block_size else ""
    return f"{layout.execution}, {layout.attention}{paged}"


def measure_batch(target, layouts: list[Layout], prompts: list[list[int]], batch: int, args, bar) -> list[dict]:
    """Every layout's γ=0 engine on these prompts, timed interleaved -> a row per layout."""
    ids = [f"plain-b{batch}-{i}" for i in range(len(prompts))]
    rows = {label(layout): dict(batch=batch, layout=label(layout)) for layout in layouts}  # layout order
    configs, captures = [], []
    for layout in layouts:
        sized = layout.for_batch(batch, max(map(len, prompts)) + args.max_new_tokens, 0)
        began = time.perf_counter()
        try:
            engine = build_engine(target, None, 0, 0, batch, sized)
        except Exception as exc:  # a layout that cannot build or capture is reported; the others run
            rows[label(layout)]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            tqdm.write(f"b={batch} {label(layout)}: {rows[label(layout)]['error']}")
            bar.update(1)
            continue
        configs.append(Config(label(layout), 0, None, engine, None))
        captures.append(time.perf_counter() - began)
    if configs:
        measure_configs(configs, prompts, ids, batch, args.max_new_tokens, args.device, args.repeats, bar)
    for config, seconds in zip(configs, captures):
        run = to_run("plain", config, batch, configs[0].outputs)
        fusion = config.engine.verifier.runner.fusion  # (compiled variants: a few expected, not one per layer)
        rows[config.name].update(tokens_per_second=run.tokens_per_second, capture_seconds=round(seconds, 1),
                                 same_as_first=run.identical, outputs=run.outputs,
                                 fused_variants=None if fusion is None else fusion.variants())
        if args.profile:
            rows[config.name]["profile"] = profile_to_file(
                args, prompts[:batch], config.name,
                lambda ps, n: generate(config.engine, ps, ids[: len(ps)], batch, n, args.device))
        del config.engine
    release_memory(args.device)
    return list(rows.values())


def profile_to_file(args, prompts: list[list[int]], name: str, run) -> dict:
    """One more run under the profiler (`gpu.profile_run`) of run(prompts, new tokens) on one
    batch of prompts and --profile-tokens new tokens (a 7B step is ~1000 kernels: the profiler's
    events stay few); its op table goes to a text file beside --out, its per-step summary is
    returned."""
    batch = len(prompts)
    steps = min(args.profile_tokens, args.max_new_tokens)
    summary, text = profile_run(lambda: run(prompts, steps), steps, args.device)
    slug = "-".join(filter(None, "".join(c if c.isalnum() else " " for c in name.lower()).split()))
    path = args.out.parent / f"{args.out.stem}-profile-b{batch}-{slug}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{name}, batch {batch}: {summary}\n\n{text}\n")
    summary["table"] = path.name
    return summary


def profile_table(rows: list[dict], anchors: list[dict]) -> str:
    """Per profiled layout and anchor: wall and device kernel ms per decode step, kernels per
    step, and the share of the wall the device was busy."""
    lines = ["", "", "profiled (one more run each, one batch, under torch.profiler; per new token, its prefill included):",
             f"{'batch':>5}  {'what':<52}{'wall ms':>9}{'kernel ms':>11}{'kernels':>9}{'busy':>7}"]
    for r in [*rows, *anchors]:
        p = r.get("profile")
        if p:
            lines.append(f"{r['batch']:>5}  {r.get('layout', r.get('anchor', '')):<52}{p['wall_ms']:>9.2f}"
                         f"{p['device_ms']:>11.2f}{p['kernels']:>9.0f}{p['busy_share']:>7.2f}")
    return "\n".join(lines) if len(lines) > 4 else ""


def with_anchors(rows: list[dict], anchors: list[dict]) -> None:
    """Each row's ratio to its batch's compiled (or on a CPU, eager) StaticCache loop and to the
    bandwidth limit; whether the anchor's tokens were the first layout's."""
    for row in (r for r in rows if "error" not in r):
        mine = [a for a in anchors if a["batch"] == row["batch"]]
        static = next((a for a in mine if a["anchor"].startswith(STATIC)), None)
        limit = next((a for a in mine if a["anchor"].startswith(LIMIT)), None)
        row["vs_static_loop"] = row["tokens_per_second"] / static["tokens_per_second"] if static else None
        row["vs_limit"] = row["tokens_per_second"] / limit["tokens_per_second"] if limit else None
        row["static_loop_same"] = static["identical"] if static else None


def table(rows: list[dict], anchors: list[dict], device: str, shape: str) -> str:
    lines = [f"plain decoding (γ=0), {device}", shape]
    head = (f"{'batch':>5}  {'layout':<28}{'tok/s':>9}{'/ static loop':>15}{'/ limit':>9}{'capture s':>11}"
            f"{'same':>6}{'compiled':>10}")
    lines += [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['batch']:>5}  {r['layout']:<28}  failed: {r['error']}")
            continue
        ratio = "-" if r["vs_static_loop"] is None else f"{r['vs_static_loop']:.2f}"
        limit = "-" if r["vs_limit"] is None else f"{r['vs_limit']:.2f}"
        lines.append(f"{r['batch']:>5}  {r['layout']:<28}{r['tokens_per_second']:>9.1f}{ratio:>15}{limit:>9}"
                     f"{r['capture_seconds']:>11}{'yes' if r['same_as_first'] else 'NO':>6}"
                     f"{'-' if r.get('fused_variants') is None else r['fused_variants']:>10}")
    lines += ["", "anchors (same prompts, same target):"]
    for a in anchors:
        same = "-" if a["identical"] is None else ("yes" if a["identical"] else "NO")
        lines.append(f"{a['batch']:>5}  {a['anchor']:<52}{a['tokens_per_second']:>10.1f}{same:>6}")
    lines.append("same: tokens equal the first layout's that ran (anchors: that layout's too). "
                 "static loop: HF StaticCache under torch.compile (reduce-overhead) on a GPU, eager on a CPU. "
                 "compiled: variants the fused blocks compiled, all layers together (a few; about one per "
                 "layer would mean each layer compiled on its own).")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve bench plain", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, eager layouts (a rehearsal)")
    p.add_argument("--layouts", default=None,
                   help="execution:attention[:block size], comma-separated; the first is the tokens' reference "
                        "(default graph:mask,fused-graph:mask,fused-graph:flex; tiny eager:mask,eager:flex)")
    p.add_argument("--batches", default=None, help="default 1,16; tiny 1,4")
    p.add_argument("--target-shape", default=None, choices=sorted(SHAPES), help="default llama2-7b")
    p.add_argument("--prompts", type=int, default=None, help="prompts at batch 1, one after another (default 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128; tiny 8")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; tiny 16")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds, median kept (default 3; tiny 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="then run each layout and the compiled anchor once more under torch.profiler: kernels and "
                        "device time per step, op tables beside --out")
    p.add_argument("--profile-tokens", type=int, default=32, help="new tokens of each profiled run (one batch)")
    p.add_argument("--out", type=Path, default=Path("bench-results/plain.json"))
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(layouts="eager:mask,eager:flex" if tiny else "graph:mask,fused-graph:mask,fused-graph:flex",
                    batches="1,4" if tiny else "1,16", target_shape="tiny-target" if tiny else "llama2-7b",
                    prompts=2 if tiny else 4, prompt_len=8 if tiny else 128, max_new_tokens=16 if tiny else 128,
                    repeats=2 if tiny else 3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = parse_layouts(args.layouts)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    target = random_llama(args.target_shape, args.device, dtype, args.seed, peaked=True)
    shape = f"target {args.target_shape}, {str(dtype).removeprefix('torch.')}, random weights"
    vocab = target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(args.seed)
    pool = torch.randint(0, vocab, (max(args.prompts, *batches), args.prompt_len), generator=generator).tolist()
    rows, anchors = [], []
    bar = tqdm(total=len(batches) * len(layouts), desc="plain bench", unit="layout")
    for batch, prompts in prompt_sets(pool, batches, args.prompts).items():
        batch_rows = measure_batch(target, layouts, prompts, batch, args, bar)
        ran = [r for r in batch_rows if "error" not in r]
        for row in ran:
            tqdm.write(f"b={batch} {row['layout']}: {row['tokens_per_second']:.1f} tok/s, "
                       f"capture {row['capture_seconds']} s, same={row['same_as_first']}")
        if ran:
            profiler = (lambda name, run: profile_to_file(args, prompts[:batch], name, run)) if args.profile else None
            anchors += measure_anchors("plain", target, prompts, batch, args.max_new_tokens, args.device,
                                       args.repeats, ran[0]["outputs"], ran[0]["tokens_per_second"],
                                       generate=False,  # (HF's eager generate(): no figure of the issue's)
                                       profiler=profiler)
        rows += batch_rows
    bar.close()
    with_anchors(rows, anchors)
    report = table(rows, anchors, device, shape) + profile_table(rows, anchors)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"device": device, "torch": torch.__version__, "shape": shape, "args": {k: str(v) for k, v in vars(args).items()},
           "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows], "anchors": anchors,
           "table": report}
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r.get("same_as_first") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
