"""Is my improvement real? Three methods on digits in one study, paired by seed, and the decision.

Plain cross-entropy (the baseline), label smoothing (a loss of your own) and a larger learning rate (a
config key), each trained for 7 replicas under the same keys: replica r of every method starts from the same
initial weights and sees the same data order, so each method is compared with the baseline seed by seed
(7 pairs: the paired t test of each difference, Holm-adjusted over the two methods).
(``python examples/methods.py [OUT]``)
"""

import sys

import jax
import optax

import nondet_jax as nj
from nondet_jax.analysis.compare import verdict


def smoothed_ce(logits, labels):
    """Cross-entropy against labels smoothed by 0.1, per example."""
    return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), 0.1))


result = nj.run_study(model="mlp", data="digits", epochs=2, batch_size=128, arms="control,all", replicas=7,
                      methods={"ce": {}, "smooth": {"loss": smoothed_ce}, "lr2x": {"optim.lr": 0.1}},
                      out=sys.argv[1] if len(sys.argv) > 1 else "runs/example-methods", log=lambda *a: None)
print(result.to_frame("methods")[["accuracy_mean_pct", "accuracy_std_pct"]].round(2))
for c in result.comparisons:  # each method against the baseline on the arm where every source varies
    lo, hi = c["difference_ci"]
    print(f"\n{c['method_b']} vs {c['method_a']} (arm {c['arm']}): accuracy {100 * c['difference']:+.2f} points "
          f"[{100 * lo:+.2f}, {100 * hi:+.2f}], Holm p = {c['p_holm']:.3g} over {c['holm_family']} methods, "
          f"better on {100 * c['probability_of_improvement']:.0f}% of seeds")
    print("decision:", verdict(c).replace("B ", f"{c['method_b']} ", 1).replace(" A", f" {c['method_a']}", 1))
print("\nreport:", result.report)
