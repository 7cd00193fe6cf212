"""Tolerances for comparing two fp32 computations of the same function that differ only in summation order.

Bitwise equality is asserted only where it is exact by construction (weights, bytes, RNG draws, schedules). Two
computations of the same model through different code paths (memory layouts, batch sizes, thread counts, rank
splits) sum the same products in different orders, because BLAS kernels pick their blocking and vector width from
the shapes, the alignment of the data and the CPU (AVX2 vs AVX-512); they agree only to fp32 rounding. Their
difference is bounded here, from first principles:

- a dot product of length K rounded in fp32 is a random walk of K roundings: its error is ~sqrt(K) * eps32
  relative to its result (eps32 = 2**-23, fp32's machine epsilon);
- a difference entering one layer comes out of the next about as large, relative to its output (layer norms keep
  magnitudes in check), and each layer adds its own: errors grow about linearly over `depth` sequential layers;
- sampling amplifies: every step adds one model call's error to the latent, and classifier-free guidance,
  neg + cfg * (pos - neg), multiplies a difference in the velocities by up to |1 - cfg| + cfg = 2 * cfg - 1.

No further slack factor: the estimate is already pessimistic where it simplifies. It takes the longest reduction of
the network for every layer, the largest magnitude of the output as the scale of every element, and linear (not
sqrt) growth over layers and steps; that covers the tail of a max over thousands of elements (~4 standard
deviations). On the AVX-512 AMD EPYC where bitwise checks failed, measured differences sit at 0-2% of it. A real
bug (a wrong item's noise or prompt, a mixed-up weight) moves the output by 0.1 or more, above every bound the
tests derive (the largest, FLUX at cfg 3.0 over 3 steps, is about 0.03).
"""
import math

EPS32 = 2.0 ** -23  # torch.finfo(torch.float32).eps


def fp32_bound(scale, *, reduction, depth=1, amplification=1.0):
    """Max abs difference expected between two fp32 evaluations of the same function in different summation orders.

    scale: magnitude of the compared values (their max abs); reduction: the longest dot product (e.g. 4096, the T5
    context width); depth: sequential layers (transformer blocks); amplification: sampling_amplification(...)."""
    return amplification * depth * math.sqrt(reduction) * EPS32 * float(scale)


def sampling_amplification(steps, cfg=1.0):
    """How much `steps` sampling steps with guidance `cfg` can grow a per-model-call difference."""
    return steps * max(1.0, 2.0 * cfg - 1.0)


def report(name, measured, bound):
    """Print the measured figure next to its bound; True when it is within. Use as `assert report(...)`."""
    measured, bound = float(measured), float(bound)
    print(f"{name}: max abs diff {measured:.3g} (bound {bound:.3g})")
    return measured <= bound


# ---- a split computation against the whole one, both against float64 (the VAE tests) --------------------------------
K = 4   # how much farther from float64 a split's float32 result may be than the unsplit float32 result


def rel(a, b) -> float:
    """Relative L2 distance of a from b, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def within(name, split32, whole32, ref64) -> bool:
    """split32 no farther from ref64 than K x whole32 is (relative L2); the figures printed."""
    measured, own = rel(split32, ref64), rel(whole32, ref64)
    print(f"{name}: vs one rank max abs {float((split32 - whole32).abs().max()):.3g}, rel L2 "
          f"{rel(split32, whole32):.3g}; vs float64 rel L2 {measured:.3g} (one rank's own {own:.3g}, bound "
          f"{K * own:.3g})")
    return measured <= K * own
