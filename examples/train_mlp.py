"""The README's one-liner as a script: `ngdist run -n 2 -- python examples/train_mlp.py`."""
from __future__ import annotations

import onnx

import ngdist
import ngdist.zoo
from ngdist.data import load_digits

if ngdist.rank() == 0:
    onnx.save(ngdist.zoo.mlp((64, 128, 10)), "mlp.onnx")
x_train, y_train, x_test, y_test = load_digits()
ngdist.barrier()  # the others wait for rank 0's file
trainer = ngdist.compile("mlp.onnx",
                         loss="softmax_cross_entropy", labels="y",
                         optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                         strategy="allreduce", bucket_bytes=25 << 20)
global_batch = 32 * ngdist.size()
for epoch in range(10):
    batches = [(x_train[i:i + global_batch], y_train[i:i + global_batch])
               for i in range(0, len(x_train) - global_batch + 1, global_batch)]
    for x, y in trainer.shard(batches):
        stats = trainer.step({"x": x, "y": y})
accuracy = (trainer.predict({"x": x_test})[0].argmax(1) == y_test).mean()
if trainer.rank == 0:
    print(f"rank 0: last loss {stats.loss:.4f}, test accuracy {accuracy:.3f}")
trainer.save("trained.onnx")
