"""ZeRO-Inference on one GPU: a Llama-shaped model, int8 weight-only, its blocks in pinned host
memory and streamed to the GPU block by block (partita.inference.host_stream), generating greedily.

    python benchmarks/zero_inference_gpu.py --shape 70b --batches 1,64 --new 8 --out results.json
    python benchmarks/zero_inference_gpu.py --shape 8b --layers 4 --batches 1 --new 4    # quick look

The model is built one decoder block at a time (random weights, bf16, on the GPU), each block
quantized to int8 at once (``quantize_weights``) so the bf16 model never exists whole; then
``HostStreamedWeights`` moves every block to pinned host memory. Only the embeddings, the final norm
and the LM head (bf16, kept unquantized) stay on the GPU. The GPU's peak memory while generating is
reported, so "the weights live on the host" is measured, not assumed.

Each token must bring every block's int8 bytes over PCIe, so the batch-1 bound is
host-to-device bandwidth / streamed bytes; the run measures that bandwidth (a pinned 2 GiB copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output_paths import output_file  # noqa: E402

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
}


def build(shape: str, layers: int | None, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from partita.inference.quantize import quantize_weights

    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, **dims)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    for block in model.model.layers:  # one bf16 block at a time, int8 right after
        block.to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        quantize_weights(block, bits=8)
    rest = [model.model.embed_tokens, model.model.norm, model.lm_head]
    for module in rest:
        module.to_empty(device=device)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.02)
        model.lm_head.weight.normal_(0.0, 0.02)
        model.model.norm.weight.fill_(1.0)
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)  # inv_freq: computed, not random
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def h2d_bandwidth() -> float:
    import torch

    host = torch.empty(2 * 1024**3, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * 2 * 1024**3 / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="70b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--out", type=output_file, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a functional check of this script, no timing meaning")
    args = parser.parse_args()

    import torch

    from partita.inference.host_stream import HostStreamedWeights
    from partita.inference.quantize import quantized_nbytes

    start = time.perf_counter()
    model = build(args.shape, args.layers, args.device)
    build_s = time.perf_counter() - start
    weight_bytes = quantized_nbytes(model)
    start = time.perf_counter()
    streamed = HostStreamedWeights(model, args.device, prefetch=args.prefetch, pin_memory=args.device == "cuda")
    pin_s = time.perf_counter() - start
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    host_bytes = streamed.nbytes_on_host()
    bandwidth = h2d_bandwidth() if cuda else float("nan")
    report = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "shape": args.shape,
              "layers": model.config.num_hidden_layers, "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
              "weight_bytes_gb": round(weight_bytes / 1e9, 2), "streamed_host_bytes_gb": round(host_bytes / 1e9, 2),
              "build_s": round(build_s, 1), "to_host_s": round(pin_s, 1), "h2d_gbps": round(bandwidth, 1),
              "resident_gib_after_move": round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None, "runs": []}
    print(json.dumps(report), flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device=args.device,
                            generator=torch.Generator(device=args.device).manual_seed(1))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                 min_new_tokens=args.new, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert out.shape == (batch, args.prompt + args.new)
        # generate runs new forwards (the prompt's, then new - 1 decode steps): each streams every block once.
        bound = bandwidth * 1e9 / host_bytes * batch
        run = {"batch": batch, "generate_s": round(seconds, 2), "tokens_per_s": round(batch * args.new / seconds, 2),
               "pcie_bound_tokens_per_s": round(bound, 2), "fraction_of_pcie_bound": round(batch * args.new / seconds / bound, 3),
               "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               "counters": {k: v for k, v in vars(streamed.counters).items() if isinstance(v, (int, float))}}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
