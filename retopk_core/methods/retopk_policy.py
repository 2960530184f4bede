"""ReTopK's decisions, free of any backend: which path each head takes (eq. 13), how the GQA policy turns
them into per-KV-group reads, which steps below the dense floor are plain dense, and the online threshold
calibration and refresh guard. Pure functions of tensors and a ``ReTopKConfig``: the torch code
(``methods/retopk.py``), the fused CPU kernel's launcher (``cpu/launch.py``) and the Triton launcher
(``kernels/triton_launch.py``) all take them from here, so each decision is written once and no launcher imports the
method that calls it.
"""

from __future__ import annotations

import torch

from retopk_core.methods.step_output import Path
from retopk_core.retopk_config import TAU_CALIBRATION_SPAN, ReTopKConfig


def below_floor(lengths: torch.Tensor, cfg: ReTopKConfig) -> torch.Tensor:
    """The dense floor: lengths (B,) L_t (the current token included) -> (B,) bool, L_t < dense_below: these
    rows attend to every position (path DENSE), in every backend."""
    return lengths < cfg.dense_below


def plain_dense(lengths: torch.Tensor, cfg: ReTopKConfig) -> torch.Tensor:
    """Rows on plain dense-floor steps: lengths (B,) L_t (the current token included) -> (B,) bool,
    L_t + C < dense_below. The FIFO keeps only its last C entries, so these steps' entries would be
    overwritten before the first sparse step at L_min: they select and push nothing (every backend)."""
    return lengths + cfg.cache_size < cfg.dense_below


def head_paths(max_sim: torch.Tensor, step: torch.Tensor, cfg: ReTopKConfig,
               phase: torch.Tensor | None = None, tau: torch.Tensor | None = None,
               period: torch.Tensor | None = None) -> torch.Tensor:
    """Equation 13, per (sequence, head): refresh, else fallback below tau, else reuse.

    max_sim (B, H) float32, step (B,) int64 t_dec, phase (H,) int64 φ_h (None = 0), tau (B, H) the heads'
    thresholds (None = cfg.tau), period (B, H) int64 the heads' refresh periods T_h (None = T_r)  ->  (B, H)
    int8 Path codes; refresh when T_r > 0, t_dec > 0 and (t_dec + φ_h) % T_h == 0, or when t_dec < 0 (the first
    ``refresh_first`` steps after a prefill, ``ReTopK.prefill``).
    """
    B, H = max_sim.shape
    T_r = cfg.refresh_every
    if T_r > 0:
        t = step.view(B, 1) + (0 if phase is None else phase.view(1, H))  # (B, H) or (B, 1)
        refresh = (step.view(B, 1) > 0) & (t % (T_r if period is None else period) == 0)
    else:
        refresh = torch.zeros(B, 1, dtype=torch.bool, device=max_sim.device)
    refresh = refresh | (step.view(B, 1) < 0)  # a turn's onset (refresh_first)
    path = torch.where(max_sim < (cfg.tau if tau is None else tau), Path.FALLBACK, Path.REUSE).to(torch.int8)
    return torch.where(refresh, torch.tensor(Path.REFRESH, dtype=torch.int8), path)


def refresh_phases(layer: int, num_heads: int, num_kv_heads: int, T_r: int) -> torch.Tensor:
    """Refresh phase of each query head of a layer under ``refresh_stagger``: (H,) int64 in [0, T_r).

    The (layer, KV group) pairs are numbered u = layer * H_kv + g and get φ_u = floor(v(u) * T_r), v the
    base-2 van der Corput sequence (u's bits mirrored behind the binary point: 0, 1/2, 1/4, 3/4, 1/8, ...),
    so any n consecutive units spread almost evenly over the T_r phases, whatever the number of layers:
    with n <= T_r and T_r a power of two no two share a phase. Every head of a group shares its phase
    (a group's keys are read once per refresh); layer 0, group 0 keeps the paper's phase 0.
    """
    G = num_heads // num_kv_heads
    phases = []
    for g in range(num_kv_heads):
        u, bits = layer * num_kv_heads + g, max(1, (layer * num_kv_heads + g).bit_length())
        mirrored = int(format(u, f"0{bits}b")[::-1], 2)  # v(u) = mirrored / 2^bits
        phases += [mirrored * T_r // 2 ** bits] * G
    return torch.tensor(phases, dtype=torch.long)


def gqa_paths(path: torch.Tensor, max_sim: torch.Tensor, num_kv_heads: int, cfg: ReTopKConfig,
              tau: torch.Tensor | None = None) -> torch.Tensor:
    """The per-head decisions of eq. 13 turned into ``cfg.gqa_policy``'s (device ops only, no host sync).

    path (B, H) int8 from ``head_paths``, max_sim (B, H)  ->  (B, H) int8. With G = H / H_kv heads per
    KV group g and ρ_h the heads' max_sim:
        head     unchanged
        promote  read_g = any_h path_h != REUSE
        group    read_g = mean_h ρ_h < tau  or  min_h ρ_h < group_tau_min   (tau: mean of the heads' tau (B, H))
    then heads of a read group take FALLBACK (ρ_h < tau) or PROMOTED, those of an unread group REUSE.
    REFRESH (every head of a sequence at once) stays as it is.
    """
    if cfg.gqa_policy == "head":
        return path
    B, H = path.shape
    G = H // num_kv_heads
    below = (path == Path.FALLBACK).view(B, num_kv_heads, G)  # (B, H_kv, G)
    if cfg.gqa_policy == "promote":
        read = below.any(-1)  # (B, H_kv)
    else:
        rho = max_sim.view(B, num_kv_heads, G)
        t = cfg.tau if tau is None else tau.view(B, num_kv_heads, G).mean(-1)
        read = (rho.mean(-1) < t) | (rho.amin(-1) < cfg.group_tau_min)  # (B, H_kv); -inf (empty FIFO) reads
    exact = torch.where(below, torch.tensor(Path.FALLBACK, dtype=torch.int8), torch.tensor(Path.PROMOTED,
                                                                                          dtype=torch.int8))
    new = torch.where(read.unsqueeze(-1), exact, torch.tensor(Path.REUSE, dtype=torch.int8)).view(B, H)
    return torch.where(path == Path.REFRESH, path, new)


# calibrate_tau's constants: observations within BAND of tau move it by RATE x (target - recall); tau stays
# within [tau0 - TAU_CALIBRATION_SPAN, tau0] (retopk_config.py): calibration only relaxes the configured tau where
# exact steps show it needless (raising it above tau0 made the embedded model read more groups for no
# measurable quality).
_CAL_RATE, _CAL_BAND = 0.1, 0.05


def calibrate_tau(tau: torch.Tensor, rho: torch.Tensor, recall: torch.Tensor, target: float,
                  tau0: float) -> torch.Tensor:
    """One online update of per-head thresholds from exact-path observations (P rows).

    tau, rho, recall (P,) float: the head's threshold, its ρ_max this step, the recall reuse would have had.
    An observation near the threshold (|ρ - tau| < BAND) moves it:  tau <- tau + RATE (target - recall),
    a stochastic approximation of the threshold at which reuse would recall ``target`` of the exact
    support on average. Heads whose supports outlive their queries' drift (on the embedded model most
    heads of the first third of the layers: reuse would recall 0.9-0.99 of their fallbacks' supports)
    move down until they seldom fall back; heads whose fallbacks are needed move back up, to tau0 at most.
    A tau that ``guard_tau`` raised above tau0 is kept as the ceiling (calibration alone never raises tau past tau0,
    and may lower a guarded one).
    """
    near = (rho - tau).abs() < _CAL_BAND
    lo, hi = _tau_bounds(tau0)
    return torch.minimum((tau + near * (_CAL_RATE * (target - recall))).clamp(min=lo), tau.clamp(min=hi))


def guard_tau(tau: torch.Tensor, rho: torch.Tensor, recall: torch.Tensor, target: float,
              margin: float = _CAL_BAND) -> torch.Tensor:
    """One online raise of heads' thresholds from exact steps where they would have reused (P rows; ``tau_guard``).

    tau, rho, recall (P,) float: the head's threshold (after this step's calibration), its ρ_max this step
    (>= the threshold it decided with), the recall reuse would have had. Such a step shows what reuse would have
    selected at a similarity the threshold trusts, so a miss there is the stale-support case no lowered
    threshold sees:
        recall <  target  ->  tau <- max(tau, min(ρ_max + margin, 1))   (this similarity no longer trusted)
    else unchanged. The head then falls back at that similarity; a fallback within BAND of tau (a query within
    BAND - margin above ρ_max, or below it) lets ``calibrate_tau`` lower tau again where it shows reuse would have
    recalled enough, so a smaller margin returns a raised tau sooner.
    """
    raised = torch.maximum(tau, (rho + margin).clamp(max=1.0))
    return torch.where(recall < target, raised, tau)


def _tau_bounds(tau0: float) -> tuple[float, float]:
    return max(0.0, tau0 - TAU_CALIBRATION_SPAN), tau0


def calibration_constants(cfg: ReTopKConfig) -> list[float]:
    """The constants of the per-head threshold's online moves, as the fused CPU and Triton kernels take them:
    calibrate_tau's (target, rate, band, lo, hi) for ``cfg``, whether the recall it, guard_period and guard_tau
    observe is ``mass_recall``'s (1.0) or the support's (0.0), then guard_tau's (target, margin) (target 0 = off)."""
    return [cfg.tau_calibration, _CAL_RATE, _CAL_BAND, *_tau_bounds(cfg.tau), float(cfg.mass_recall),
            cfg.tau_guard, cfg.tau_guard_margin]


# guard_period's constants: a head's refresh period stays within [T_r / 2^LEVELS, T_r]; it lengthens only when
# the measured recall clears the target by MARGIN, or by half the distance to 1 when that is less (a mass target
# such as 0.95; ``guard_fresh``) (the safety margin: a head near its target keeps refreshing often rather than
# oscillate into stale supports).
_GUARD_LEVELS, _GUARD_MARGIN = 3, 0.1


def guard_period(period: torch.Tensor, recall: torch.Tensor, target: float, T_r: int) -> torch.Tensor:
    """One online update of heads' refresh periods from their scheduled refreshes (P rows; ``refresh_guard``).

    period (P,) int64 T_h, recall (P,) float the recall reuse would have had at this refresh (observed only
    where the head would have reused: ρ_max >= tau_h). A refresh is the stalest point of a head's reuse run:
    its supports were last anchored up to T_h steps ago. So
        recall <  target            ->  T_h <- max(T_h / 2, T_r / 2^LEVELS)   (stale: re-anchor sooner)
        recall >= guard_fresh       ->  T_h <- min(2 T_h, T_r)               (fresh: back towards T_r)
    else unchanged. Each head starts at the shortest period (``QuerySupportCache``): a session's first
    refreshes come early, so a head whose supports go stale is caught within T_r / 2^LEVELS steps, and a
    head on stable text earns T_r after LEVELS refreshes (steps T_r / 8, T_r / 4, T_r / 2: three exact steps
    more than the fixed schedule, once per session). T_h stays a power-of-two divisor of T_r (T_r a power of
    two), so the scheduled refreshes of T_r are kept; a text whose attention drifts faster than reuse tracks
    it (similar queries, supports gone stale, which no threshold on ρ catches) is refreshed more often.
    """
    shorter = torch.clamp(period // 2, min=guard_floor(T_r))
    longer = torch.clamp(period * 2, max=T_r)
    return torch.where(recall < target, shorter, torch.where(recall >= guard_fresh(target), longer, period))


def guard_fresh(target: float) -> float:
    """The recall at which ``guard_period`` lengthens a period: target + MARGIN, or target + (1 - target) / 2 when
    that is less."""
    return target + (_GUARD_MARGIN if target + 2 * _GUARD_MARGIN <= 1.0 else (1.0 - target) / 2)


def guard_constants(cfg: ReTopKConfig) -> list[float]:
    """guard_period's (target, target + margin, lowest period) for ``cfg`` (target 0 = off), as the fused CPU
    kernel takes them (the sum made here, as guard_period makes it, so both round it alike)."""
    return [cfg.refresh_guard, guard_fresh(cfg.refresh_guard), float(guard_floor(cfg.refresh_every))]


def guard_floor(T_r: int) -> int:
    """The shortest refresh period ``guard_period`` gives a head: T_r / 2^LEVELS, at least 1 (T_r > 0)."""
    return max(1, T_r >> _GUARD_LEVELS)
