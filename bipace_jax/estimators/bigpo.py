"""BiGPO step level (state side only): GiGPO's formula over fingerprint clusters.

`docs/estimators.md`, "Step level" (`bigpo`) and "Clustering". Step groups are the clusters of
`clustering.greedy_cosine_clusters` (degenerate and overflow rows are singletons); then
  A_step = (R_i - mean_C(R)) / (std_C(R) + 1e-6)   (norm="mean_std"; "mean": no division),
0 for singletons and all-equal clusters, exactly as `gigpo`.
"""

from __future__ import annotations

from bipace_jax.estimators import gigpo
from bipace_jax.estimators.base import CLUSTER, EstimatorSpec

SPEC = EstimatorSpec("bigpo", CLUSTER, gigpo.step_advantage, gigpo.reference_step)
