/* The gated MLP activations, one element each: silu(g) * u and gelu_tanh(g) * u. Shared by
 * elementwise.c's SiLU- and GELU-and-multiply kernels and quant_int8act.c's down projection, which
 * makes them in its activation quantization (the fp32 rows never written): one source, the same
 * operations, so the same bits in both (tests/test_quant_int8act.py compares them).
 *
 * silu(g) = g * sigmoid(g) with the sigmoid taken from e^-|g| (in (0, 1]: no overflow on either
 * side); gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) with the tanh from e^-2|y|
 * (in (0, 1]); both vectorize with fast_exp.h's exp. */
#ifndef LLMSERVE_GLU_H
#define LLMSERVE_GLU_H

#include <math.h>

#include "fast_exp.h"

static inline __attribute__((always_inline)) float silu_mul(float g, float u) {
    const float e = exp_nonpositive(-fabsf(g));
    const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
    return g * sigmoid * u;
}

static inline __attribute__((always_inline)) float gelu_tanh_mul(float g, float u) {
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = exp_nonpositive(-2.0f * fabsf(y));
    const float th = (1.0f - e) / (1.0f + e);
    return 0.5f * g * (1.0f + (y >= 0.0f ? th : -th)) * u;
}

#endif
