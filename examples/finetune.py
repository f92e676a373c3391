"""Fine-tuning: a network pre-trained on digits 0-4, fine-tuned on digits 5-9 with a new head, and
which sources its replicas' spread comes from once every replica starts from the same pre-trained body.
(``python examples/finetune.py [OUT]``, under a minute on a CPU)

Both steps are made here: the pre-training is a one-replica study, its weights file holds the body;
``init_params`` starts every fine-tuning replica from that body, so the ``init`` arm varies only the
new head (drawn from each replica's init key) and ``data_order`` only the order of the new data.
"""

import sys
from pathlib import Path

import flax.linen as nn
import numpy as np
import optax
from sklearn.datasets import load_digits

import nondet_jax as nj


class Net(nn.Module):
    num_classes: int = 5

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.relu(nn.Dense(64, name="body")(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes, name="head")(h)


out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example-finetune")
d = load_digits()
x, y = (d.images / 16.0).reshape(len(d.images), -1).astype(np.float32), d.target
old, new = y < 5, y >= 5  # pre-train on 0-4, fine-tune on 5-9 (labels 0-4 again)
xo, yo, xn, yn = x[old], y[old], x[new], y[new] - 5
quiet = {"log": lambda *a, **k: None, "settings": {"metrics.pairwise": False, "metrics.lmc_pairs": 0}}
nj.run_study(model=Net, data=(xo[:700], yo[:700], xo[700:], yo[700:]), optimizer=optax.adam(3e-3), epochs=5,
             batch_size=50, arms="control", replicas=1, out=out / "pretrain", **quiet)

body = nj.load_params(out / "pretrain" / "weights" / "control.npz", replica=0)
del body["head"]  # a new head for the new classes: drawn from each replica's init key
result = nj.run_study(model=Net, data=(xn[:700], yn[:700], xn[700:], yn[700:]), optimizer=optax.adam(3e-3),
                      epochs=3, batch_size=50, arms="control,init,data_order,all", replicas=4, init_params=body,
                      out=out / "finetune", settings={"metrics.lmc_pairs": 0}, log=lambda *a, **k: None)
for row in result.table:
    print(f"{row['arm']:<10} accuracy {row['accuracy_mean_pct']:.1f}% ± {row['accuracy_std_pct']:.2f}%")
print("report:", result.report)
