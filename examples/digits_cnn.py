"""Your own Flax CNN and optax optimiser on scikit-learn's handwritten digits: how much of the
test accuracy is luck? (``python examples/digits_cnn.py [OUT]``; about a minute on a laptop CPU.)"""

import sys

import flax.linen as nn
import numpy as np
import optax
from sklearn.datasets import load_digits

import nondet_jax as nj


class SmallCNN(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        # BatchNorm: the batch_stats collection. Momentum 0.8: over a short study's few dozen steps
        # Flax's default 0.99 leaves the running statistics mostly at their initial values.
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        x = nn.max_pool(x, (2, 2), (2, 2)).reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64, name="penultimate")(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)  # dropout: the "dropout" rng, fed by the dropout source
        return nn.Dense(self.num_classes)(x)


digits = load_digits()
x = (digits.images[..., None] / 16.0).astype(np.float32)  # (1797, 8, 8, 1) NHWC
y = digits.target
result = nj.run_study(model=SmallCNN, data=(x[:1400], y[:1400], x[1400:], y[1400:]),
                      optimizer=optax.adamw(3e-3, weight_decay=1e-4), epochs=3, batch_size=100,
                      arms="control,init,data_order,dropout,all", replicas=3, features="penultimate",
                      out=sys.argv[1] if len(sys.argv) > 1 else "runs/example-digits-cnn")
for row in result.table:
    print(f"{row['arm']:<10} accuracy {row['accuracy_mean_pct']:.1f}% +- {row['accuracy_std_pct']:.2f}%")
print("report:", result.report)
