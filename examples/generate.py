"""Batched generation of a DeepSeek-V3.2, GLM-5 (GLM-MoE-DSA) or DeepSeek-V4 model --
transformers' own model definitions -- through torch_kvcm2, with every layer's sparse history (the
512 + 64 latent of the real models; V4's compressed sparse attention entries) in host pages and
each request's selected tokens (entries) in GPU cells (MOD-5, STR-1).

By default a tiny random model built from an embedded config (no download); ``--model DIR``
loads a local checkpoint directory instead. Requests of different prompt lengths join at
different steps (``--arrivals``) when a row is free, prefill in chunks (``--prefill-chunk``),
decode greedily (or ``--sample``) and leave when done. Prints each request's tokens, tokens/s,
the cells' hit rate and the bytes moved (``manager.metrics()``). ``--check`` decodes every request
again with the stock model and its own dense cache (alone, teacher-forced on the tokens generated
here) and exits 1 on a difference: a token that is not the stock argmax (beyond a near tie), or a
logit further off than the dtype's tolerance (docs/MODELS.md says what is exact and why).

    python examples/generate.py                       # tiny DeepSeek-V3.2, greedy
    python examples/generate.py --arch glm --check    # tiny GLM-5, checked against stock
    python examples/generate.py --mode absorbed       # MLA weight absorption over the K selected
    python examples/generate.py --compile             # decode steps under torch.compile(fullgraph)
    python examples/generate.py --graph               # decode steps replayed as a CUDA graph (GPU)
    python examples/generate.py --arch v4 --check     # tiny DeepSeek-V4: CSA entries in host pages
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flags import add_device_flag, needs_gpu, pick_device, positive_int  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def int_list(text: str) -> list:
    """argparse type: comma-separated ints >= 0."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 0")
    return values


def positive_list(text: str) -> list:
    values = int_list(text)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", choices=("v32", "glm", "v4"), default="v32",
                   help="the tiny random model: DeepSeek-V3.2 or GLM-MoE-DSA (not with --model)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a local checkpoint directory of a DeepseekV32ForCausalLM or "
                        "GlmMoeDsaForCausalLM (config.json and weights; nothing is downloaded)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="the model's dtype, hence the cached latents' and indexer keys'")
    p.add_argument("--mode", choices=("scatter", "absorbed"), default="scatter",
                   help="scatter: the selected latents put back at their positions, then the "
                        "stock attention; absorbed: MLA weight absorption over the K selected")
    p.add_argument("--kernel", choices=("torch", "sparse_mla", "reference"), default="torch",
                   help="the absorbed decode: this library's torch computation, or "
                        "torch_kvcm2.models.sparse_mla over the cells (its Triton kernel on a GPU, "
                        "torch elsewhere; the real 512 + 64 latent only), or its plain reference; "
                        "needs --mode absorbed unless torch")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                   help="transformers' attention implementation")
    p.add_argument("--prompt-lengths", type=positive_list, default=[37, 150, 300, 90],
                   help="one prompt of random token ids per request")
    p.add_argument("--new-tokens", type=positive_list, default=[16, 8, 20, 12],
                   help="tokens to generate per request (one value: the same for all)")
    p.add_argument("--arrivals", type=int_list, default=[0, 0, 2, 6],
                   help="the step at which each request arrives (one value: the same for all)")
    p.add_argument("--rows", type=positive_int, default=3,
                   help="batch rows: requests beyond them wait for a free row")
    p.add_argument("--prefill-chunk", type=positive_int, default=64,
                   help="prompt tokens a request prefills per step")
    p.add_argument("--hot-tokens", type=positive_int, default=None,
                   help="cell slots per request and indexer, rounded up to whole pages; None: "
                        "twice the top-k")
    p.add_argument("--page-tokens", type=positive_int, default=64, help="tokens per page")
    p.add_argument("--gpu-history", type=int, default=0, metavar="TOKENS",
                   help="tokens of the rows' sparse history to keep on GPU pages as well (rows "
                        "whose history fits skip the cells: no miss, no fetch); 0, the "
                        "default: all of it offloaded")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="with --sample")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
    p.add_argument("--check", action="store_true",
                   help="compare with the stock transformers decode; exit 1 on a difference")
    p.add_argument("--compile", action="store_true",
                   help="run decode steps under torch.compile(fullgraph=True)")
    p.add_argument("--graph", action="store_true",
                   help="replay decode steps as one captured CUDA graph (GPU only)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (0: torch's default); the tiny model's matrix "
                        "products are too small to gain from more, and on a busy machine "
                        "threads wait on each other")
    add_device_flag(p)
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error("argument --threads: must be >= 0")
    n = len(args.prompt_lengths)
    for name in ("new_tokens", "arrivals"):
        values = getattr(args, name)
        if len(values) == 1:
            setattr(args, name, values * n)
        elif len(values) != n:
            p.error(f"argument --{name.replace('_', '-')}: {len(values)} values for {n} prompts "
                    f"(give one per --prompt-lengths entry, or one for all)")
    if args.temperature <= 0:
        p.error("argument --temperature: must be > 0")
    if args.kernel != "torch" and args.mode != "absorbed":
        p.error(f"argument --kernel: {args.kernel} computes the absorbed decode; "
                f"add --mode absorbed")
    if args.compile and args.graph:
        p.error("argument --graph: not allowed with argument --compile")
    if args.arch == "v4":  # eager scatter-back over its streams (torch_kvcm2/models/v4.py)
        for flag, on in (("--mode absorbed", args.mode != "scatter"),
                         ("--kernel", args.kernel != "torch"), ("--compile", args.compile),
                         ("--graph", args.graph), ("--gpu-history", args.gpu_history),
                         ("--model", args.model is not None)):
            if on:
                p.error(f"argument {flag.split()[0]}: not supported with --arch v4")
    if args.model is not None and not os.path.isdir(args.model):
        p.error(f"argument --model: {args.model!r} is not a directory")
    return p, args


def load_model(args, device):
    import torch_kvcm2.models as models

    dtype = DTYPES[args.dtype]
    if args.model is None:
        # the Triton sparse MLA kernel reads the real 512 + 64 latent row; a captured decode
        # step needs a MoE computation without host reads (models.tiny.CAPTURABLE_EXPERTS)
        shape = models.tiny.REAL_LATENT if args.kernel == "sparse_mla" else {}
        experts = models.tiny.CAPTURABLE_EXPERTS if args.graph else None
        model = models.tiny_model(args.arch, dtype=dtype, seed=args.seed,
                                  attn_implementation=args.attn, device=device,
                                  experts_implementation=experts, **shape)
        name = {"v32": "DeepSeek-V3.2", "glm": "GLM-MoE-DSA",
                "v4": "DeepSeek-V4"}[args.arch] + " tiny random"
        return model, name
    transformers = models.import_transformers()
    config = transformers.AutoConfig.from_pretrained(args.model, local_files_only=True)
    cls = models.tiny.model_class(config)
    extra = {"experts_implementation": models.tiny.CAPTURABLE_EXPERTS} if args.graph else {}
    model = cls.from_pretrained(args.model, local_files_only=True, dtype=dtype,
                                attn_implementation=args.attn, **extra).to(device).eval()
    return model, f"{cls.__name__} from {args.model}"


def report(gen, model_name, args, wall):
    spec = gen.spec
    if spec.arch == "v4":
        shape = (f"layers {' '.join(t.split('_')[0] for t in spec.layer_types)}, window "
                 f"{spec.sliding_window}, entries of {spec.head_dim} per {spec.csa_rate} / "
                 f"{spec.hca_rate} tokens, top-{spec.index_topk} entries")
    else:
        shape = (f"{spec.num_layers} layers, {spec.num_heads} heads, latent {spec.kv_lora_rank} "
                 f"+ {spec.rope_dim}, top-{spec.index_topk}, {len(spec.leaders)} indexer(s)")
    print(f"device {gen.device.type}: {model_name} ({shape}), {args.dtype}, {args.mode} mode, "
          f"{len(gen.requests)} request(s) on {gen.batch.max_rows} row(s), prefill chunks of "
          f"{args.prefill_chunk}, {'sampled' if args.sample else 'greedy'}")
    for req in gen.requests:
        print(f"request {req.request_id}: prompt {len(req.prompt)} tokens, joined at step "
              f"{req.joined_step}, finished at step {req.finished_step}: "
              f"{' '.join(map(str, req.generated))}")
    m = gen.metrics()
    g = m["generator"]
    rate = g["decode_tokens"] / g["decode_seconds"] if g["decode_seconds"] else 0.0
    total = sum(len(r.generated) for r in gen.requests)
    setup = {"compiled": f" (the first decode step, which compiled, took "
                         f"{g['setup_seconds']:.1f} s and is not counted)",
             "graph": f" (the first decode step, run eagerly, and the capture took "
                      f"{g['setup_seconds']:.1f} s and are not counted)"}.get(g["decode"], "")
    print(f"decode ({g['decode']}): {g['decode_tokens']} tokens in {g['decode_steps']} steps, "
          f"{g['decode_seconds']:.2f} s = {rate:.0f} tokens/s{setup}; all {gen.steps} steps "
          f"(prefill included): {total} tokens in {wall:.2f} s = {total / wall:.0f} tokens/s")
    groups = m["selection_groups"]
    hits = sum(v["hits"] for v in groups.values())
    misses = sum(v["misses"] for v in groups.values())
    per = ", ".join(f"{name} {v['hits'] / max(v['hits'] + v['misses'], 1):.2f}"
                    for name, v in groups.items())
    print(f"hit rate {hits / max(hits + misses, 1):.2f} ({hits} hits, {misses} misses; {per})")
    fetched = sum(v["fetched_bytes"] for v in groups.values())
    print(f"bytes moved: {fetched:,} host->device (cell misses), {m['flushed_bytes']:,} "
          f"device->host (flushed in-flight tokens), {m['host_direct_bytes']:,} written straight "
          f"to host pages (prefill)")
    if args.gpu_history:
        gh = m["gpu_history"]
        print(f"GPU-resident history: {gh['promotions']} row(s) moved onto GPU pages "
              f"({gh['promoted_bytes']:,} bytes of history copied in), {gh['demotions']} "
              f"demoted (pages full or a prefill chunk), {gh['rows']} row(s) there now")


def check(gen, model, args) -> bool:
    from torch_kvcm2.models import reference

    tolerance = reference.TOLERANCE[DTYPES[args.dtype]]
    started = time.perf_counter()
    expected = {req.request_id: reference.stock_request_logits(model, req.prompt, req.generated,
                                                               args.prefill_chunk)
                for req in gen.requests}
    greedy = not args.sample and tolerance.tokens
    result = reference.compare(gen.requests, expected, near=tolerance.max_diff, greedy=greedy)
    what = (f"{len(gen.requests)} request(s), {result.compared} logit rows vs stock transformers "
            f"(its DynamicCache, each request alone, teacher-forced; "
            f"{time.perf_counter() - started:.1f} s)")
    bound = f"max {tolerance.max_diff:g}" + (f", mean {tolerance.mean_diff:g}"
                                             if tolerance.mean_diff is not None else "")
    found = ("bit-identical" if result.exact else
             f"max |logit diff| {result.max_diff:.1e}, mean {result.mean_diff:.1e} "
             f"(tolerance {bound})")
    ties = f", {len(result.near_ties)} near tie(s)" if result.near_ties else ""
    if result.ok(tolerance):
        tokens = ", every greedy token the stock argmax" if greedy else ""
        print(f"check passed: {what}: {found}{tokens}{ties}")
        return True
    print(f"check FAILED: {what}: {found}; tokens that differ (request, step, ours, stock): "
          f"{result.token_mismatches[:8]}{ties}")
    return False


def main(argv=None) -> int:
    parser, args = parse(sys.argv[1:] if argv is None else argv)
    device = pick_device(args.device)
    if args.graph and device.type != "cuda":
        needs_gpu("--graph (CUDA graph replay)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        import torch_kvcm2.models as models
        models.import_transformers()
    except (ImportError, RuntimeError) as error:
        parser.exit(2, f"{os.path.basename(sys.argv[0])}: error: {error}\n")
    model, name = load_model(args, device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    longest = max(p + n for p, n in zip(args.prompt_lengths, args.new_tokens))
    page = args.page_tokens
    static = -(-longest // page) * page if (args.compile or args.graph) else None
    gen = models.Generator(
        model, max_rows=args.rows, max_tokens_per_row=-(-longest // page) * page,
        mode=args.mode, prefill_chunk=args.prefill_chunk, hot_tokens=args.hot_tokens,
        tokens_per_page=page, gpu_history_tokens=args.gpu_history, sample=args.sample,
        temperature=args.temperature, seed=args.seed,
        record_logits=args.check, static_length=static,
        kernel=None if args.kernel == "torch" else args.kernel)
    for length, new, arrival in zip(args.prompt_lengths, args.new_tokens, args.arrivals):
        prompt = torch.randint(2, vocab, (length,), generator=g).tolist()
        gen.submit(prompt, new, arrival)
    if args.compile:
        print("compiling the decode step at the first decode step (may take minutes on a CPU)...",
              file=sys.stderr, flush=True)
        gen.compile_decode()
    if args.graph:
        gen.capture_decode()
    started = time.perf_counter()
    gen.run()
    report(gen, name, args, time.perf_counter() - started)
    ok = check(gen, model, args) if args.check else True
    gen.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
