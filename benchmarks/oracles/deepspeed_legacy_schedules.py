"""Oracle: DeepSpeed 0.18.9 (last release with PLD + legacy curriculum) on CPU, GA 2, 20 steps."""
import json, os, sys
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
import torch, deepspeed
print("deepspeed", deepspeed.__version__, deepspeed.__file__, file=sys.stderr)
deepspeed.init_distributed(dist_backend="gloo")

class Rec(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.lin = torch.nn.Linear(4, 1); self.seen = []
    def forward(self, x, **kw):
        self.seen.append({k: (float(v) if k == "pld_theta" else v) for k, v in kw.items()})
        return self.lin(x).pow(2).mean()

def run(extra, steps=20, ga=2, save=None, load=None):
    torch.manual_seed(0)
    m = Rec()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, **extra}
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    if load:
        eng.load_checkpoint(load)
    rows = []
    for micro in range(steps * ga):
        before = (eng.global_steps, eng.get_pld_theta())
        loss = eng(torch.ones(2, 4))
        eng.backward(loss); eng.step()
        rows.append({"gs_before": before[0], "theta_before_fwd": before[1], "kwargs": m.seen[-1],
                     "theta_after_step": eng.get_pld_theta(),
                     "cur_diff": eng.curriculum_scheduler_legacy.get_current_difficulty()
                     if getattr(eng, "curriculum_scheduler_legacy", None) else None})
        if save and eng.global_steps == save[1] and eng.is_gradient_accumulation_boundary() is False:
            pass
        if save and eng.global_steps == save[1] and micro % ga == ga - 1:
            eng.save_checkpoint(save[0], tag="t")
    eng.eval(); m.seen.clear(); eng(torch.ones(2, 4)); eval_kwargs = m.seen[-1]; eng.train()
    return {"rows": rows, "eval_kwargs": eval_kwargs}

out = {}
pld = {"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1}}
cl = lambda st, sc: {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                             "max_difficulty": 64, "schedule_type": st, "schedule_config": sc}}
out["pld_linear"] = run({**pld, **cl("fixed_linear", {"total_curriculum_step": 12, "difficulty_step": 8})},
                        save=("/tmp/ds_legacy_oracle_ckpt", 10))
out["pld_resume"] = run({**pld, **cl("fixed_linear", {"total_curriculum_step": 12, "difficulty_step": 8})},
                        steps=4, load="/tmp/ds_legacy_oracle_ckpt")
out["root"] = run(cl("fixed_root", {"total_curriculum_step": 12, "difficulty_step": 8, "root_degree": 2}))
out["discrete"] = run(cl("fixed_discrete", {"difficulty": [8, 16, 32], "max_step": [3, 7]}))
out["other_type"] = run({"curriculum_learning": {"enabled": True, "curriculum_type": "vocab", "min_difficulty": 8,
   "max_difficulty": 64, "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 12, "difficulty_step": 8}}}, steps=3)
json.dump(out, open("ds_legacy_schedules.json", "w"), indent=1)
