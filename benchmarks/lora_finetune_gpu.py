"""LoRA fine-tuning at ZeRO-3 on one GPU: ``PartitaTrainer`` against HF ``Trainer`` + DeepSpeed ZeRO-3.

    python benchmarks/lora_finetune_gpu.py --out lora.json              # one H200, both engines
    python benchmarks/lora_finetune_gpu.py --tiny                       # CPU smoke test, tiny Llama

Issue 29's Measure: LoRA (r 16 on q/k/v/o and gate/up/down projections) of a Llama-3-8B-shaped
model (its config, random weights, bf16) at ZeRO-3, the same ``TrainingArguments`` for both: partita
through ``partita.integrations.hf.PartitaTrainer(partita_config=...)``, DeepSpeed through
``Trainer(args=TrainingArguments(deepspeed=<the same dict>))``. Each engine runs in its own process
(DeepSpeed's ``zero.Init`` and partita's patch torch differently; a fresh process also gives each a
clean CUDA allocator). Both build the base the way their users do at ZeRO-3: partita under
``partita.zero.Init``, DeepSpeed through transformers' ``from_config`` with the DeepSpeed
TrainingArguments alive (``deepspeed.zero.Init``); then peft's ``get_peft_model`` (partita's wrapper).
The data is random token windows, the same for both (seeded), labels = inputs. (The two engines'
random initial weights differ, each Init draws them its own way; the speed does not depend on them.)

Timing: a callback synchronizes and reads the clock at every optimizer step's end; the first
``--warmup`` steps are left out. tokens/s = micro_batch x seq x timed steps / their seconds. Peak
memory is ``torch.cuda.max_memory_allocated()`` over the whole ``train()`` (reset just before it).
Goal (issue 29): partita >= 1.3x DeepSpeed's tokens/s at <= its peak memory.

Results format (one JSON object on stdout, also written to ``--out``):
    {"benchmark": "lora_finetune", "date", "command", "shape": {...}, "settings": {...},
     "engines": {"partita": RESULT, "deepspeed": RESULT},
     "speedup_tokens_per_s": partita / deepspeed, "peak_ratio": partita / deepspeed}
    RESULT = {"tokens_per_s", "step_s" (median of timed steps), "step_times_s", "peak_allocated_gib"
              (null on CPU), "trainable_params", "total_params", "losses", "versions"}
    or {"skipped": "<why>"} / {"failed": "<last lines of its stderr>"}.

``--tiny``: a 2-layer Llama on CPU, fp32, 4 steps, the same code path. The DeepSpeed side runs with
``--ds-python`` (default: ``.bench-venv/bin/python`` when it exists, with ``DS_ACCELERATOR=cpu``); when
that interpreter has no deepspeed the side is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output_paths import output_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B), written out: the GPU machine reaches no hub.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                 bos_token_id=128000, eos_token_id=128001)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def zero3_config() -> dict:
    """The one DeepSpeed-style dict both engines get; "auto" values come from the TrainingArguments."""
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}, "steps_per_print": 1_000_000}


def single_process_env() -> None:
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29581", "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(name, value)


class StepClock:
    """A TrainerCallback (built lazily: transformers is imported in the worker only) that records
    each optimizer step's end time after a device synchronize."""

    @staticmethod
    def make():
        import torch
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self) -> None:
                self.marks: list[float] = []

            def _sync(self) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()

            def on_train_begin(self, args, state, control, **kw):
                self._sync()
                self.marks.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kw):
                self._sync()
                self.marks.append(time.perf_counter())

        return _Clock()


def timed(marks: list[float], warmup: int) -> list[float]:
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return steps[warmup:] if len(steps) > warmup else steps


def random_windows(n: int, seq: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq), generator=gen)
    return [{"input_ids": row, "labels": row.clone(), "attention_mask": torch.ones_like(row)} for row in ids]


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "deepspeed", "trl", "partita"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def worker(engine: str, args: argparse.Namespace) -> dict:
    """One engine's run, in this process."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    single_process_env()
    shape = TINY if args.tiny else LLAMA3_8B
    config = LlamaConfig(**shape)
    bf16 = not args.tiny
    dtype = torch.bfloat16 if bf16 else torch.float32
    ds = zero3_config()
    settings = dict(output_dir=os.path.join(args.workdir, engine), per_device_train_batch_size=args.batch,
                    gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-4, max_grad_norm=1.0,
                    bf16=bf16, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                    gradient_checkpointing=args.gradient_checkpointing,
                    # Non-reentrant: the frozen embedding's output needs no grad for it (peft + reentrant needs
                    # enable_input_require_grads); the same for both engines.
                    gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=args.tiny,
                    dataloader_num_workers=0, remove_unused_columns=False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    torch.manual_seed(0)
    if engine == "deepspeed":
        import peft

        targs = TrainingArguments(**settings, deepspeed=ds)  # alive: from_config builds under deepspeed.zero.Init
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = peft.get_peft_model(model, lora)
        trainer_cls, extra = Trainer, {}
    else:
        import partita
        from partita.integrations import peft_support
        from partita.integrations.hf import PartitaTrainer

        targs = TrainingArguments(**settings)
        with partita.zero.Init(config_dict_or_path={"zero_optimization": ds["zero_optimization"],
                                                    "bf16": {"enabled": bf16}}):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = peft_support.get_peft_model(model, lora)
        trainer_cls, extra = PartitaTrainer, {"partita_config": ds}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
    clock = StepClock.make()
    trainer = trainer_cls(model=model, args=targs, train_dataset=random_windows(args.steps * args.batch, args.seq,
                                                                                config.vocab_size),
                          callbacks=[clock], **extra)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    steps = timed(clock.marks, args.warmup)
    return {"tokens_per_s": round(args.batch * args.seq * len(steps) / sum(steps), 1),
            "step_s": round(statistics.median(steps), 4), "step_times_s": [round(s, 4) for s in steps],
            "peak_allocated_gib": None if peak is None else round(peak, 2), "trainable_params": trainable,
            "total_params": total, "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "versions": versions()}


def ds_side_python(args: argparse.Namespace) -> tuple[str, dict]:
    """The interpreter and extra environment the DeepSpeed worker runs with."""
    env = {}
    python = args.ds_python
    bench = os.path.join(REPO, ".bench-venv", "bin", "python")
    if python is None:
        python = bench if args.tiny and os.path.exists(bench) else sys.executable
    if args.tiny:
        env["DS_ACCELERATOR"] = "cpu"
    return python, env


def missing_modules(python: str, modules: list[str]) -> list[str]:
    code = ("import importlib.util,sys; print(','.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True)
    return [m for m in out.stdout.strip().split(",") if m]


def fallback_path(python: str) -> str | None:
    """This interpreter's site-packages, for the DeepSpeed interpreter to fall back on (appended to its
    sys.path by the worker, so its own packages win): .bench-venv has deepspeed, torch and
    transformers but not peft, trl or datasets. None when both are the same interpreter."""
    import sysconfig

    if os.path.abspath(python) == os.path.abspath(sys.executable):  # venvs share one base interpreter: no realpath
        return None
    return sysconfig.get_paths()["purelib"]


def run_side(script: str, engine: str, python: str, env_extra: dict, argv: list[str], workdir: str) -> dict:
    result = os.path.join(workdir, f"{engine}.json")
    env = {**os.environ, **env_extra, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), REPO) if p)}
    cmd = [python, script, *argv, "--worker", engine, "--result", result, "--workdir", workdir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(result):
        return {"failed": (proc.stderr or proc.stdout)[-3000:], "rc": proc.returncode}
    with open(result) as f:
        return json.load(f)


def drive(script: str, args: argparse.Namespace, argv: list[str], benchmark: str, needs: list[str]) -> dict:
    """Runs each engine in its own process (``script --worker ENGINE``) and puts their results side by side;
    ``needs``: the modules the DeepSpeed side borrows from this interpreter when its own lacks them."""
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"{benchmark}_")
    engines: dict = {}
    for engine in args.engines.split(","):
        if engine == "partita":
            engines[engine] = run_side(script, engine, sys.executable, {}, argv, workdir)
            continue
        python, env = ds_side_python(args)
        lacking = missing_modules(python, ["deepspeed", *needs])
        if [m for m in lacking if m != "deepspeed"] and fallback_path(python):
            env["PARTITA_BENCH_FALLBACK_PATH"] = fallback_path(python)
        if "deepspeed" in lacking:
            engines[engine] = {"skipped": f"{python} has no deepspeed (install .whl/deepspeed-*.whl, or give "
                                          f"--ds-python an interpreter that has it)"}
            continue
        engines[engine] = run_side(script, engine, python, env, argv, workdir)
    return {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "engines": engines}


def ratio(report: dict, key: str, invert: bool = False) -> float | None:
    a, b = (report["engines"].get(name, {}).get(key) for name in ("partita", "deepspeed"))
    if not a or not b:
        return None
    return round(b / a if invert else a / b, 3)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny Llama on CPU, fp32: the smoke test")
    p.add_argument("--engines", default="partita,deepspeed")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 12; 4 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 2; 1 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; 32 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch per step (default 4; 2 with --tiny)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    p.add_argument("--ds-python", default=None, help="interpreter for the DeepSpeed side (default: this one; "
                                                     ".bench-venv's with --tiny)")
    p.add_argument("--out", type=output_file, default=None)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=("partita", "deepspeed"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def fill_defaults(args: argparse.Namespace, full: dict, tiny: dict) -> None:
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def forwarded(argv: list[str]) -> list[str]:
    """The driver's own arguments minus --out/--workdir (the worker gets its own)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--out", "--workdir", "--ds-python", "--engines"):
            skip = True
            continue
        if item.startswith(("--out=", "--workdir=", "--ds-python=", "--engines=")):
            continue
        out.append(item)
    return out


def use_fallback_path() -> None:
    """In a worker: packages this interpreter lacks come from the driver's (see fallback_path)."""
    extra = os.environ.get("PARTITA_BENCH_FALLBACK_PATH")
    if extra and extra not in sys.path:
        sys.path.append(extra)


def main() -> None:
    use_fallback_path()
    args = parser().parse_args()
    fill_defaults(args, {"steps": 12, "warmup": 2, "seq": 2048, "batch": 4},
                  {"steps": 4, "warmup": 1, "seq": 32, "batch": 2})
    if args.worker:
        with open(args.result, "w") as f:
            json.dump(worker(args.worker, args), f)
        return
    report = drive(os.path.abspath(__file__), args, forwarded(sys.argv[1:]), "lora_finetune", ["peft"])
    report["shape"] = TINY if args.tiny else LLAMA3_8B
    report["settings"] = {"lora_r": 16, "lora_alpha": 32, "targets": LORA_TARGETS, "zero_stage": 3,
                          "precision": "fp32" if args.tiny else "bf16", "micro_batch": args.batch, "seq": args.seq,
                          "steps": args.steps, "warmup": args.warmup,
                          "gradient_checkpointing": args.gradient_checkpointing, "config": zero3_config()}
    report["speedup_tokens_per_s"] = ratio(report, "tokens_per_s")
    report["peak_ratio"] = ratio(report, "peak_allocated_gib")
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
