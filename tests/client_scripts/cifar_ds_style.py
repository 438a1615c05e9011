"""A DeepSpeedExamples-style CIFAR-10 training script (training/cifar/cifar10_deepspeed.py's shape).

Written as a DeepSpeed user writes it: argparse flags plus ``deepspeed.add_config_arguments``,
``deepspeed.init_distributed()``, rank 0 preparing the data first behind a barrier, a
DeepSpeed config dict that still carries the deprecated keys such scripts ship with
(``prescale_gradients``, ``cpu_offload``, ``fp16_master_weights_and_grads``,
``allgather_partitions``, all at their no-op values), ``deepspeed.initialize(args=...,
model=..., model_parameters=..., training_data=...)``, ``get_accelerator().device_name(
model_engine.local_rank)`` and the fp16/bf16 switches through ``model_engine.fp16_enabled()``.
The only change from the DeepSpeed version is the import (``CIFAR_BACKEND=deepspeed`` runs the
very same code on DeepSpeed, where it is installed).

The data is a synthetic CIFAR-shaped set (3x32x32 images, 10 classes) generated from a fixed
seed, so nothing is downloaded: each class has its own random mean image, plus noise.

    partita run tests/client_scripts/cifar_ds_style.py --epochs 2 --dtype bf16
    python tests/client_scripts/cifar_ds_style.py --deepspeed_config my_ds_config.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

if os.environ.get("CIFAR_BACKEND") == "deepspeed":
    import deepspeed
    from deepspeed.accelerator import get_accelerator
else:
    import partita as deepspeed
    from partita.accelerator import get_accelerator


def add_argument(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2000, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage used for training")
    parser.add_argument("--train-samples", default=512, type=int, help="size of the synthetic training set")
    parser.add_argument("--lr", default=0.001, type=float, help="peak learning rate (the example's 0.001)")
    parser.add_argument("--warmup-steps", default=1000, type=int, help="WarmupLR warmup_num_steps")
    parser.add_argument("--seed", default=1234, type=int, help="seed of the model's initial weights")
    parser.add_argument("--losses-out", default=None, type=str, help="write the per-step losses (rank 0) as JSON here")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


class SyntheticCIFAR(torch.utils.data.Dataset):
    """CIFAR-10-shaped samples from a fixed seed: (3x32x32 float image, int label).

    ``seed`` fixes the classes' mean images; the train and test splits draw their samples from
    them with different generators.
    """

    def __init__(self, num_samples: int, *, seed: int, train: bool = True) -> None:
        class_means = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed + (1 if train else 2))
        self.labels = torch.randint(0, 10, (num_samples,), generator=g)
        self.images = class_means[self.labels] + torch.randn(num_samples, 3, 32, 32, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def get_ds_config(args: argparse.Namespace) -> dict:
    """The example's config, deprecated keys included (each at its no-op value)."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": args.lr, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": args.warmup_steps},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


def main(argv: list[str] | None = None) -> dict:
    args = add_argument(argv)
    deepspeed.init_distributed()

    # Rank 0 prepares the data first (the example downloads it there), the others wait.
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()
    trainset = SyntheticCIFAR(args.train_samples, seed=0, train=True)
    testset = SyntheticCIFAR(256, seed=0, train=False)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()

    torch.manual_seed(args.seed)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    ds_config = None if args.deepspeed_config else get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config,
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank

    # For float32, target_dtype stays None: no cast of the inputs.
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()

            # The mean loss over the ranks, so every rank records the global batch's loss.
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / torch.distributed.get_world_size())
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0

    correct = total = 0
    model_engine.eval()
    with torch.no_grad():
        for start in range(0, len(testset), 64):
            images, labels = testset.images[start : start + 64], testset.labels[start : start + 64]
            if target_dtype is not None:
                images = images.to(target_dtype)
            predicted = model_engine(images.to(local_device)).argmax(dim=1)
            total += labels.size(0)
            correct += (predicted.cpu() == labels).sum().item()
    result = {
        "losses": losses,
        "accuracy": correct / total,
        "device_name": local_device,
        "local_rank": local_rank,
        "fp16": model_engine.fp16_enabled(),
        "bf16": model_engine.bfloat16_enabled(),
        "global_samples": model_engine.global_samples,
    }
    if local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total : .0f} %")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
