"""``ngdist rewrite``: insert a strategy's communication ops into a saved model."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rewrite", help="insert the strategy's comm ops into a training model",
                       description="Read a model, build the training step if it is forward-only "
                       "(needs --optimizer; --loss defaults to softmax_cross_entropy), insert "
                       "the strategy's communication ops and lower everything to ordinary ONNX "
                       "ops. The output is a standard ONNX training model.")
    p.add_argument("input", help="forward-only or training .onnx file")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--strategy", default="allreduce",
                   help="communication strategy (default allreduce)")
    p.add_argument("--bucket-bytes", type=int, default=25 << 20,
                   help="fuse gradients into AllReduce buckets of at most this many bytes "
                        "(default 25 MiB, as PyTorch DDP; 0 = one per gradient)")
    p.add_argument("--loss", help="softmax_cross_entropy | mse | none (output is the loss)")
    p.add_argument("--labels", default="y", help="name of the labels input (default y)")
    p.add_argument("--optimizer", help="e.g. sgd:lr=0.05,momentum=0.9,nesterov=1 or adam:lr=1e-3")
    p.add_argument("--params", help="comma-separated initializers to train (default: all float)")
    p.add_argument("--frozen", help="comma-separated initializers to keep fixed")
    p.add_argument("--graph", dest="opt_graph", choices=["exponential", "ring"],
                   help="pushsum: gossip graph (default exponential)")
    p.add_argument("--peers-per-itr", dest="opt_peers_per_itr", type=int,
                   help="pushsum: out-peers per iteration (default 1)")
    p.add_argument("--overlap", dest="opt_overlap", action="store_const", const=True,
                   help="pushsum: non-blocking gossip, messages added one iteration later")
    p.add_argument("--grad-shard-bytes", dest="opt_grad_shard_bytes", type=int,
                   help="ps: cut the gradients into shards of at most this many bytes "
                        "(default 10,000,000 as Ray SGD; 0 = one shard per owner)")
    p.add_argument("--all-reduce-alg", dest="opt_all_reduce_alg",
                   help="allreduce: mpi (default) | ring | recursive_doubling | hierarchical "
                        "| exact")
    p.add_argument("--reproducible-micro-batch", dest="opt_reproducible_micro_batch",
                   type=int, metavar="M",
                   help="allreduce: reproducible mode, gradients of micro-batches of M "
                        "samples summed exactly (the same bits on any number of ranks)")
    p.add_argument("--synch-freq", dest="opt_synch_freq", type=int,
                   help="pushsum with --overlap: iterations a message may lag (default 0)")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from ngdist import optim
    from ngdist.api import _UNSET, to_training_model
    from ngdist.ir.model import save_proto
    from ngdist.passes.pipeline import rewrite

    opts = {}
    if args.loss is not None:
        opts["loss"] = None if args.loss == "none" else args.loss
    if args.optimizer is not None:
        opts["optimizer"] = optim.from_spec(args.optimizer)
    model = to_training_model(args.input, labels=args.labels,
                              params=args.params.split(",") if args.params else None,
                              frozen=args.frozen.split(",") if args.frozen else None,
                              loss=opts.get("loss", _UNSET),
                              optimizer=opts.get("optimizer", _UNSET))
    extra = {k: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    out = rewrite(model, args.strategy, bucket_bytes=args.bucket_bytes,
                  **{k[4:]: v for k, v in extra.items()})
    save_proto(out, args.output)
    print(f"wrote {args.output} (strategy {args.strategy})")
    return 0
