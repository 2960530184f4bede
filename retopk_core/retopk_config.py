"""Hyperparameters of ReTopK (the paper's K, C, W, R, tau, T_r), validated on construction.

Each field is declared once below (default, doc, bounds; see ``retopk_core.params``): validation, the
server's wire conversion and command line, and ``describe()`` all read these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

from retopk_core.params import MethodConfig, ParamError, param

GQA_POLICIES = ("head", "promote", "group")
# How far tau calibration may lower a head's threshold below the configured tau (retopk_policy.calibrate_tau).
TAU_CALIBRATION_SPAN = 0.35


@dataclass(frozen=True)
class ReTopKConfig(MethodConfig):
    """ReTopK hyperparameters, defaults as in the paper (K=512, C=W=32, R=4, tau=0.85, T_r=128).

    gqa_policy: how the G = H / H_kv query heads sharing a KV group decide (GQA). A head on an exact path
    reads every key of its group, so what a step costs is how many groups are read, not how many heads
    fall back:
        "head"     the paper: each head decides alone (eq. 13)
        "promote"  as "head"; then, in a group read for any of its heads, every head takes the exact
                   support too (path PROMOTED): better supports and more exact FIFO entries for the same
                   key reads
        "group"    one decision per group: read it when the mean of its heads' ρ_max is below tau or
                   their lowest is below group_tau_min; a read group's heads all take the exact support
                   (FALLBACK below tau, else PROMOTED), an unread group's heads all reuse
    """

    top_k: int = param(512, "K: tokens attended per head and step (the support size)", low=1,
                       context=True)
    cache_size: int = param(32, "C: capacity of each head's FIFO of (unit-norm query, support) pairs", low=1,
                            context=True)
    window: int = param(32, "W: recent positions always added to the candidate set", low=0, context=True)
    recall: int = param(4, "R: cached entries recalled per step (R <= C)", low=1)
    tau: float = param(0.85, "fall back to Exact Top-K when the max cached-query cosine < tau", low=0.0, high=1.0)
    refresh_every: int = param(128, "T_r: exact refresh when the decode-step offset t_dec > 0 and t_dec % T_r == 0; "
                                    "0 disables scheduled refresh", low=0, context=True)
    retrieval: str = param("similarity", "'similarity' (the paper) or 'recent' (the ablation that recalls the R "
                                         "newest entries instead of the R most similar)",
                           choices=("similarity", "recent"))
    gqa_policy: str = param("head", "how the query heads of a KV group decide: head (the paper), promote or group "
                                    "(see the class docstring)", choices=GQA_POLICIES)
    group_tau_min: float = param(0.0, "'group' policy: the lowest ρ_max of a group that still lets it reuse (0 = only "
                                      "the mean decides)", low=0.0, high=1.0)
    dense_below: int = param(0, "L_min: a sequence shorter than this (the current token included) attends to every "
                                "position (path DENSE); its last cache_size such steps also push the exact Top-K of "
                                "those scores into the FIFO, so the first sparse step at L_min finds exact supports; "
                                "0 = never (the paper)", low=0,
                             context=True)
    refresh_first: int = param(0, "N: the first N decode steps after each prefill (a turn's prompt) refresh every "
                                  "head: the prefill sets t_dec to -N and a step with t_dec < 0 takes REFRESH. The "
                                  "FIFO's seeds are the prompt's queries, whose supports miss what an answer's first "
                                  "tokens read (a needle the question asks for) at similarities reuse trusts; the "
                                  "onset's exact supports enter the FIFO for later steps to recall. Scheduled "
                                  "refreshes then count from the onset's end; 0 = off (t_dec counts from the first "
                                  "prefill, the paper)", low=0, context=True)
    refresh_stagger: bool = param(False, "stagger scheduled refreshes over (layer, KV group): each refreshes every "
                                         "T_r steps at its own phase (same average rate), so no step refreshes every "
                                         "layer at once; False = the paper (all at t_dec = T_r, 2T_r, ...)")

    tau_calibration: float = param(0.0, f"r*: lower each head's tau online (to tau - {TAU_CALIBRATION_SPAN} at most) "
                                        "towards the similarity at which reuse would still recall a share r* of the "
                                        "exact support (0 = the paper's fixed tau; see retopk_policy.calibrate_tau)",
                                   low=0.0, high=1.0)

    refresh_guard: float = param(0.0, "r_g: staleness guard: each head's refresh period starts at its shortest; "
                                      "on its refreshes where it would have reused (rho_max >= its tau) the recall "
                                      "reuse would have had is measured: below r_g the period halves, well above it "
                                      "it doubles (to T_r at most); 0 = the fixed T_r (the floor and the margin: "
                                      "retopk_policy.guard_period)",
                                 low=0.0, high=1.0)

    mass_recall: bool = param(False, "tau_calibration, refresh_guard and tau_guard measure the recall reuse would "
                                     "have had as attention mass: the share of the exact Top-K's softmax weight on the "
                                     "positions reuse would have found, instead of the share of its positions (a "
                                     "missed token counts by its weight; see fidelity.mass_recall)")

    recall_successors: bool = param(False, "A_t also holds the successor p + 1 of every recalled support position "
                                           "(eq. 9 shifted by one): a head that copies a span (an induction head "
                                           "reading a number out of the context) attends one position further each "
                                           "step, which supports recalled from earlier steps miss")
    tau_guard: float = param(0.0, "r_t: on an exact step where a head would have reused (a refresh or a promotion "
                                  "with rho_max >= its tau), a recall reuse would have had under r_t raises that "
                                  "head's tau to rho_max + tau_guard_margin (at most 1), so its similar queries fall "
                                  "back; tau_calibration may lower it again (retopk_policy.guard_tau); 0 = off",
                             low=0.0, high=1.0)
    tau_guard_margin: float = param(0.05, "tau_guard: how far above the missing step's rho_max the raised tau lies; "
                                          "under calibration's band (0.05) the fallbacks it causes lie within the "
                                          "band, so tau_calibration lowers it again where reuse would have recalled "
                                          "r*", low=0.0, high=0.5)

    def validate(self) -> None:
        if self.refresh_guard and self.refresh_every <= 0:
            raise ParamError("refresh_guard", "refresh_guard needs scheduled refreshes (refresh_every > 0), got "
                                              f"refresh_every={self.refresh_every}")
        if self.recall > self.cache_size:
            raise ParamError("recall", f"recall must be <= cache_size ({self.cache_size}), got {self.recall}")
