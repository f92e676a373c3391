"""A non-image model: an MLP on scikit-learn's wine data (178 examples, 13 features, 3 classes),
SGD with momentum. (``python examples/wine_mlp.py [OUT]``)"""

import sys

import flax.linen as nn
import numpy as np
import optax
from sklearn.datasets import load_wine

import nondet_jax as nj


class MLP(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(self.num_classes)(x)


wine = load_wine()
order = np.random.default_rng(0).permutation(len(wine.target))  # a fixed split: the data is not a source here
x, y = wine.data[order].astype(np.float32), wine.target[order]
x = (x - x[:128].mean(0)) / x[:128].std(0)  # standardised with the training split's statistics
result = nj.run_study(model=MLP, data=(x[:128], y[:128], x[128:], y[128:]),
                      optimizer=optax.sgd(0.05, momentum=0.9), epochs=10, batch_size=32,
                      arms="control,init,data_order,all", replicas=4,
                      out=sys.argv[1] if len(sys.argv) > 1 else "runs/example-wine-mlp")
for arm, logits in result.logits.items():
    acc = (logits.argmax(-1) == y[128:]).mean(-1)
    print(f"{arm:<10} test accuracy per replica: {np.round(100 * acc, 1)}")
print("report:", result.report)
