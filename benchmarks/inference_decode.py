"""Decoding speed on one GPU: partita's init_inference against plain Hugging Face generate and
DeepSpeed's init_inference, on a Llama-3-8B-shaped model (random weights from its config; nothing
is downloaded), bf16, greedy, a fixed number of prompt and new tokens.

    python benchmarks/inference_decode.py --out benchmarks/results/inference_decode_h200.json
    python benchmarks/inference_decode.py --variants hf_eager,partita --batches 1 --layers 4   # quick look

Every variant runs in a fresh process (its own CUDA context, allocator and compile caches) on the
same weights (one seed). Each process builds the model, runs one untimed generate (compilation and
CUDA-graph capture happen there), then times ``--repeats`` generates and keeps the fastest. The
prompt's forward (prefill) is timed on its own, eagerly, before any variant touches the model, so
decoding's own rate (new tokens after the first, per second) is reported beside the end-to-end rate
without a second generate of another length (under a static cache that would compile again) and
without a per-token host callback (a streamer would synchronise every step).

The batch-1 bound is the HBM-bandwidth limit: each decoded token reads every weight once (the
embedding table only one row) plus the KV cache so far, so tokens/s <= bandwidth / bytes read per
token. The bandwidth is measured in the run (a device-to-device copy: bytes read + written, per
second) and the nominal figure is reported beside it.

Variants:
  hf_eager     model.generate, dynamic cache, no compile (what most users run)
  hf_compiled  Hugging Face's own recipe: generation_config.cache_implementation="static", which makes
               generate compile its decode steps (CompileConfig: fullgraph, mode="reduce-overhead")
  static_loop  partita.inference.static_decode.StaticDecoder(compile=True) alone (no init_inference)
  partita      partita.init_inference(model, dtype=bf16, enable_cuda_graph=True).generate
  deepspeed    deepspeed.init_inference(model, dtype=bf16, replace_with_kernel_inject=False).module.generate
               (kernel injection needs DeepSpeed's compiled inference ops, which the wheel here lacks)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output_paths import output_file  # noqa: E402

VARIANTS = ("hf_eager", "hf_compiled", "static_loop", "partita", "deepspeed")
NOMINAL_HBM_TBPS = 4.8  # H200 SXM datasheet


def llama3_8b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    )


def build_model(layers: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = llama3_8b_config(layers)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    # Random weights put EOS anywhere: no stopping, every row decodes exactly --new tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def measured_bandwidth() -> float:
    """Device-to-device copy: bytes read + written per second (TB/s)."""
    import torch

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 * reps / seconds / 1e12


def bytes_per_token(model, batch: int, context: int) -> int:
    """Bytes one batch-1 decode step must read: weights (the input embedding: one row) + KV cache."""
    config = model.config
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    weights += embed.shape[1] * embed.element_size()
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * context * batch
    return weights + kv


def make_generate(variant: str, model):
    import torch

    if variant == "hf_eager":
        return model.generate
    if variant == "hf_compiled":
        from transformers import CompileConfig

        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        return model.generate
    if variant == "static_loop":
        from partita.inference.static_decode import StaticDecoder

        return StaticDecoder(model, compile=True).generate
    if variant == "partita":
        import partita

        engine = partita.init_inference(model, dtype=torch.bfloat16, enable_cuda_graph=True)
        return engine.generate
    if variant == "deepspeed":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        import deepspeed

        engine = deepspeed.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=False,
                                          tensor_parallel={"tp_size": 1})
        return engine.module.generate
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def worker(args) -> dict:
    import torch

    model = build_model(args.layers)
    vocab = model.config.vocab_size
    prompts = {}
    for batch in args.batches:
        gen = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(0, vocab, (batch, args.prompt), device="cuda", generator=gen)
        with torch.no_grad():
            model(input_ids=ids)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            torch.cuda.synchronize()
        prompts[batch] = (ids, time.perf_counter() - start)
    generate = make_generate(args.variant, model)
    results = []
    for batch in args.batches:
        ids, prefill_s = prompts[batch]
        mask = torch.ones_like(ids)

        def run():
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - start, out

        first_s, out = run()  # compile / capture happen here
        assert out.shape == (batch, args.prompt + args.new), tuple(out.shape)
        timings = [run()[0] for _ in range(args.repeats)]
        best = min(timings)
        decode_tps = batch * (args.new - 1) / (best - prefill_s)
        context = args.prompt + args.new // 2  # the KV cache's mean length while decoding
        results.append({
            "batch": batch, "first_generate_s": round(first_s, 2), "generate_s": round(best, 4),
            "all_generate_s": [round(t, 4) for t in timings], "prefill_s": round(prefill_s, 4),
            "tokens_per_s": round(batch * args.new / best, 1), "decode_tokens_per_s": round(decode_tps, 1),
            "bytes_per_token": bytes_per_token(model, batch, context),
            "first_tokens": out[0, args.prompt: args.prompt + 16].tolist(),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        })
        print(json.dumps({"variant": args.variant, **results[-1]}), flush=True)
    return {"variant": args.variant, "runs": results, "bandwidth_tbps": round(measured_bandwidth(), 3),
            "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-3-8B)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=output_file, default=None)
    parser.add_argument("--worker", dest="variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.variant is not None:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    report = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "layers": args.layers,
              "prompt_tokens": args.prompt, "new_tokens": args.new, "nominal_hbm_tbps": NOMINAL_HBM_TBPS, "variants": {}}
    for variant in args.variants.split(","):
        command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--batches", ",".join(map(str, args.batches)),
                   "--layers", str(args.layers), "--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats)]
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            report["variants"][variant] = {"error": (proc.stderr or proc.stdout)[-3000:]}
            print(f"{variant}: FAILED\n{(proc.stderr or proc.stdout)[-3000:]}", flush=True)
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        for run in result["runs"]:
            bound = result["bandwidth_tbps"] * 1e12 / run["bytes_per_token"] * run["batch"]
            run["bandwidth_bound_tokens_per_s"] = round(bound, 1)
            run["fraction_of_bound"] = round(run["decode_tokens_per_s"] / bound, 3)
        report["variants"][variant] = result
        print(json.dumps(result), flush=True)
    summary = []
    for variant, result in report["variants"].items():
        for run in result.get("runs", []):
            summary.append(f"{variant:12s} batch {run['batch']:3d}: {run['tokens_per_s']:8.1f} tok/s end to end, "
                           f"{run['decode_tokens_per_s']:8.1f} decode, {run['fraction_of_bound']:.0%} of the bound")
    print("\n".join(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
