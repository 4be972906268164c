"""BiGPO step level (state side only): GiGPO's formula over fingerprint clusters.

Spec: estimators.md, "Step level" (`bigpo`) and "Clustering (BiGPO)". Step groups are the clusters
of `clustering.greedy_cosine_clusters` (degenerate and overflow rows are singletons); then
  A_step = (R_i - mean_C(R)) / (std_C(R) + 1e-6)   (norm="mean_std"; "mean": no division),
0 for singletons and all-equal clusters, exactly as `gigpo`.
"""

from __future__ import annotations

from bipace_jax.estimators import gigpo


def step_advantage(returns, cluster_labels, include, num_segments: int, norm: str):
    """GiGPO's normalised step advantage inside each cluster; float32[N]."""
    return gigpo.step_advantage(returns, cluster_labels, include, num_segments, norm)
