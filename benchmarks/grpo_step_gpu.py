"""A GRPO step (rollout generation + training) on one GPU: ``with_partita(GRPOTrainer)`` against
TRL's ``GRPOTrainer`` + DeepSpeed ZeRO-3.

    python benchmarks/grpo_step_gpu.py --out grpo.json                   # one H200, both engines
    python benchmarks/grpo_step_gpu.py --tiny                            # CPU smoke test, tiny Qwen2
    python benchmarks/grpo_step_gpu.py --engines partita --cuda-graph    # partita's CUDA-graph rollouts

Issue 29's Measure: a ~0.5B Qwen2-shaped policy (Qwen2-0.5B's config, random weights, bf16) trained by
TRL's GRPOTrainer with the same ``GRPOConfig`` for both engines, ZeRO-3, a reference model
(``beta`` > 0: partita makes it an inference-only ZeRO-3 engine, DeepSpeed a ZeRO-3 eval engine)
and a rule reward (distinct words in the completion). Each optimizer step generates one batch
of rollouts (``steps_per_generation`` = gradient accumulation = 1) from the ZeRO-3 policy
(partita: ``engine.generate`` gathered once per call; DeepSpeed: TRL's
``unwrap_model_for_generation`` with ``ds3_gather_for_generation``), scores them with the
reference and trains on them. The policy and a word-level tokenizer whose vocabulary matches the
model's are saved once by the driver (TRL loads the reference from the policy's path); each engine
then runs in its own process. No hub access is needed.

Timing: a callback synchronizes and reads the clock at every optimizer step's end; the first
``--warmup`` steps are left out. steps/s = timed steps / their seconds; peak memory is
``torch.cuda.max_memory_allocated()`` over ``train()``. Goal (issue 29): partita >= 2x DeepSpeed's
step rate.

Results format (one JSON object on stdout, also written to ``--out``):
    {"benchmark": "grpo_step", "date", "command", "shape": {...}, "settings": {...},
     "engines": {"partita": RESULT, "deepspeed": RESULT}, "speedup_steps_per_s": partita / deepspeed}
    RESULT = {"steps_per_s", "step_s" (median), "step_times_s", "peak_allocated_gib" (null on CPU),
              "completion_tokens_per_step" (mean of TRL's logged completions/mean_length x generation batch),
              "losses", "rewards", "versions"}
    or {"skipped": "<why>"} / {"failed": "<last lines of its stderr>"}.

``--tiny``: a 2-layer Qwen2 on CPU, fp32, 3 steps, the same code path; the DeepSpeed side runs with
``.bench-venv/bin/python`` (``DS_ACCELERATOR=cpu``; trl, datasets and peft borrowed from this
interpreter when it lacks them), skipped with the reason when no deepspeed is found.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_finetune_gpu import (StepClock, drive, fill_defaults, forwarded, ratio, single_process_env,  # noqa: E402
                               timed, use_fallback_path, versions, zero3_config)
from output_paths import output_file  # noqa: E402

# Qwen2-0.5B's config.json (Qwen/Qwen2-0.5B), written out; max_position_embeddings cut to what a step uses.
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, use_sliding_window=False)
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_assets(args: argparse.Namespace) -> dict:
    """The policy (random weights) and its tokenizer, saved under the work directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    shape = TINY if args.tiny else QWEN2_05B
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), shape["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    paths = {"tok": os.path.join(args.workdir, "tok"), "policy": os.path.join(args.workdir, "policy")}
    tok.save_pretrained(paths["tok"])
    torch.manual_seed(0)
    config = Qwen2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen2ForCausalLM(config).to(torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(paths["policy"])
    return paths


def prompts(n: int, words: int, vocab: int):
    import torch
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(len(SPECIALS), vocab, (n, words), generator=gen).tolist()
    return Dataset.from_list([{"prompt": " ".join(f"w{i}" for i in row)} for row in ids])


def distinct_words(completions, **kwargs) -> list[float]:
    """Reward: the share of distinct words (cheap, and it varies across a group, so advantages are non-zero)."""
    return [len(set(c.split())) / max(1, len(c.split())) for c in completions]


def worker(engine: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    single_process_env()
    paths = {"tok": os.path.join(args.workdir, "tok"), "policy": os.path.join(args.workdir, "policy")}
    bf16 = not args.tiny
    ds = zero3_config()
    settings = dict(output_dir=os.path.join(args.workdir, engine), per_device_train_batch_size=args.batch,
                    gradient_accumulation_steps=1, num_generations=args.generations,
                    max_completion_length=args.completion, max_steps=args.steps, learning_rate=1e-6, beta=0.04,
                    max_grad_norm=1.0, bf16=bf16, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                    disable_tqdm=True, use_cpu=args.tiny, use_vllm=False,
                    model_init_kwargs={"dtype": torch.float32 if args.tiny else torch.bfloat16})
    if engine == "deepspeed":
        cls, targs, extra = GRPOTrainer, GRPOConfig(**settings, deepspeed=ds), {}
    else:
        from partita.integrations.hf import with_partita

        if args.cuda_graph:  # partita's rollouts through its static-cache CUDA-graph loop (partita only)
            ds = {**ds, "generation": {"cuda_graph": True}}
        cls, targs, extra = with_partita(GRPOTrainer), GRPOConfig(**settings), {"partita_config": ds}
    shape = TINY if args.tiny else QWEN2_05B
    clock = StepClock.make()
    trainer = cls(model=paths["policy"], reward_funcs=[distinct_words], args=targs,
                  train_dataset=prompts(args.steps * args.batch, args.prompt, shape["vocab_size"]),
                  processing_class=AutoTokenizer.from_pretrained(paths["tok"]), callbacks=[clock], **extra)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    steps = timed(clock.marks, args.warmup)
    logs = trainer.state.log_history
    lengths = [e["completions/mean_length"] for e in logs if "completions/mean_length" in e]
    return {"steps_per_s": round(len(steps) / sum(steps), 4), "step_s": round(statistics.median(steps), 4),
            "step_times_s": [round(s, 4) for s in steps],
            "peak_allocated_gib": None if peak is None else round(peak, 2),
            "completion_tokens_per_step": round(statistics.mean(lengths) * args.batch, 1) if lengths else None,
            "losses": [e["loss"] for e in logs if "loss" in e], "rewards": [e["reward"] for e in logs if "reward" in e],
            "versions": versions()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny Qwen2 on CPU, fp32: the smoke test")
    p.add_argument("--engines", default="partita,deepspeed")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps, each with its rollouts (default 8; 3 tiny)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 2; 1 tiny)")
    p.add_argument("--batch", type=int, default=None, help="completions per step (default 16; 4 tiny)")
    p.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8; 2 tiny)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 64; 4 tiny)")
    p.add_argument("--completion", type=int, default=None, help="max completion tokens (default 256; 8 tiny)")
    p.add_argument("--ds-python", default=None, help="interpreter for the DeepSpeed side (default: this one; "
                                                     ".bench-venv's with --tiny)")
    p.add_argument("--cuda-graph", action="store_true",
                   help='partita side: config "generation": {"cuda_graph": true} (rollouts decoded by partita\'s '
                        "static-KV-cache loop with CUDA-graph decode steps; on CPU it has no effect)")
    p.add_argument("--out", type=output_file, default=None)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=("partita", "deepspeed"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main() -> None:
    import tempfile

    use_fallback_path()
    args = parser().parse_args()
    fill_defaults(args, {"steps": 8, "warmup": 2, "batch": 16, "generations": 8, "prompt": 64, "completion": 256},
                  {"steps": 3, "warmup": 1, "batch": 4, "generations": 2, "prompt": 4, "completion": 8})
    if args.batch % args.generations:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --generations {args.generations}: GRPO "
                         "groups each prompt's completions in one batch; pick a multiple")
    if args.worker:
        with open(args.result, "w") as f:
            json.dump(worker(args.worker, args), f)
        return
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_step_")
    single_process_env()
    build_assets(args)
    report = drive(os.path.abspath(__file__), args, forwarded(sys.argv[1:]), "grpo_step", ["trl", "datasets"])
    report["shape"] = TINY if args.tiny else QWEN2_05B
    report["settings"] = {"zero_stage": 3, "precision": "fp32" if args.tiny else "bf16", "batch": args.batch,
                          "generations": args.generations, "prompt_tokens": args.prompt,
                          "max_completion_tokens": args.completion, "beta": 0.04, "steps": args.steps,
                          "warmup": args.warmup, "config": zero3_config(),
                          "partita_generation_cuda_graph": args.cuda_graph}
    report["speedup_steps_per_s"] = ratio(report, "steps_per_s")
    report["peak_ratio"] = ratio(report, "peak_allocated_gib")
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
