"""The numbers behind issue 25's notes, rerunnable: what the identity check costs, and what BatchNorm's
running-average momentum does to the README's own-model example.

    python experiments/study_identity.py timing     # identity of the default study, traced twice
    python experiments/study_identity.py readme-bn  # README example at BatchNorm momentum 0.99 and 0.8

``readme-bn`` trains the README example (SmallCNN on digits, adamw 3e-3, 2 epochs, batch 100, arms
control,init,data_order,all, R=3) at both momenta and prints each arm's table accuracy beside the
accuracy at its LMC endpoints (BatchNorm recomputed there); both write JSON under experiments/results/.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def timing() -> dict:
    from nondet_jax import config as cfg
    from nondet_jax.machine import xla_flags
    from nondet_jax.study.prepare import model_record, prepare

    config = cfg.Config()
    data, fns = prepare(config)
    seconds = []
    for _ in range(3):
        t0 = time.perf_counter()
        model_record(config, data, fns)
        seconds.append(time.perf_counter() - t0)
    print(f"identity of the default study ({config.model.name} on {config.data.name}): "
          + ", ".join(f"{s:.3f} s" for s in seconds) + " (first call, then warm)")
    return {"seconds": seconds, "cpu": xla_flags.cpu_model()}


def readme_bn() -> dict:
    import flax.linen as nn
    import optax
    from sklearn.datasets import load_digits

    import nondet_jax as nj

    d = load_digits()
    x, y = (d.images[..., None] / 16.0).astype(np.float32), d.target
    out = {}
    print(f"{'momentum':>8} {'arm':<11} {'table acc %':>11} {'LMC endpoint acc %':>19}")
    for momentum in (0.99, 0.8):
        class SmallCNN(nn.Module):
            num_classes: int = 10

            @nn.compact
            def __call__(self, x, train: bool):
                x = nn.relu(nn.Conv(16, (3, 3))(x))
                x = nn.BatchNorm(use_running_average=not train, momentum=momentum)(x)
                x = nn.max_pool(x, (2, 2), (2, 2)).reshape(x.shape[0], -1)
                return nn.Dense(self.num_classes)(nn.relu(nn.Dense(64)(x)))

        with tempfile.TemporaryDirectory() as tmp:
            result = nj.run_study(model=SmallCNN, data=(x[:1400], y[:1400], x[1400:], y[1400:]),
                                  optimizer=optax.adamw(3e-3), epochs=2, batch_size=100,
                                  arms="control,init,data_order,all", replicas=3, out=Path(tmp) / "run",
                                  log=lambda *a, **k: None)
            for row in result.table:
                with np.load(result.out / "pairs" / f"{row['arm']}.npz") as p:
                    ends = 100 * (1 - np.concatenate([p["lmc_curves"][:, 0], p["lmc_curves"][:, -1]]).mean())
                out[f"{momentum}/{row['arm']}"] = {"table": row["accuracy_mean_pct"], "lmc_endpoints": float(ends)}
                print(f"{momentum:>8} {row['arm']:<11} {row['accuracy_mean_pct']:>11.2f} {ends:>19.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("timing", "readme-bn"))
    args = p.parse_args()
    result = timing() if args.what == "timing" else readme_bn()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"study_identity_{args.what}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
