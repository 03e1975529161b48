"""``ngdist demo``: train an MLP on the bundled digits data, data-parallel over the MPI ranks."""
from __future__ import annotations

import argparse
import logging
import sys
import time

import numpy as np
from tqdm import tqdm

import ngdist
from ngdist import zoo
from ngdist.cli.run import add_launch_arguments, launch
from ngdist.cli.train import epoch_mean_loss
from ngdist.comm import world_rank_size
from ngdist.data import load_digits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ngdist demo")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    x_train, y_train, x_test, y_test = load_digits()
    trainer = ngdist.compile(zoo.mlp((64, 256, 10), seed=0), loss="softmax_cross_entropy",
                             labels="y", optimizer=ngdist.optim.SGD(lr=args.lr, momentum=0.9),
                             strategy="allreduce")
    rank, size = trainer.rank, trainer.size
    global_batch = args.batch_size * size
    steps_per_epoch = len(x_train) // global_batch
    start = time.perf_counter()
    bar = tqdm(total=args.epochs * steps_per_epoch, disable=rank != 0, unit="step",
               desc=f"digits MLP on {size} rank(s)")
    loss = float("nan")
    for epoch in range(args.epochs):
        perm = np.random.default_rng(epoch).permutation(len(x_train))  # same on every rank
        batches = ((x_train[perm[i:i + global_batch]], y_train[perm[i:i + global_batch]])
                   for i in range(0, steps_per_epoch * global_batch, global_batch))
        epoch_loss = np.zeros(2)  # this rank's sum of step losses, steps
        for x, y in trainer.shard(batches):
            epoch_loss += (trainer.step({"x": x, "y": y}).loss, 1)
            bar.update(1)
        loss = epoch_mean_loss(trainer, epoch_loss)
        bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}")
    bar.close()
    accuracy = float((trainer.predict({"x": x_test})[0].argmax(1) == y_test).mean())
    if rank == 0:
        print(f"ranks: {size}  epochs: {args.epochs}  global batch: {global_batch}  "
              f"time: {time.perf_counter() - start:.1f} s")
        print(f"last epoch's training loss (mean over ranks): {loss:.4f}")
        print(f"test accuracy: {accuracy:.4f} on {len(y_test)} held-out digits")
    if args.save:
        trainer.save(args.save)
        if rank == 0:
            print(f"saved trained model to {args.save}")
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train an MLP on the bundled digits data on 2 ranks",
                       description="The README's first command: a real distributed training "
                       "run (scikit-learn's 8x8 digits, bundled) with a progress bar, then the "
                       "test accuracy.")
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save", help="write the trained model here")
    add_launch_arguments(p)
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    argv = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr)] + (["--save", args.save] if args.save else [])
    if (args.n > 1 or args.max_restarts) and world_rank_size()[1] == 1:  # supervised
        return launch([sys.executable, "-m", "ngdist.cli.demo", *argv], args.n, args)
    return main(argv)
