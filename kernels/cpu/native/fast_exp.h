/* e^x for x <= 0, to about 2 ulp, written without calls so that the compiler vectorizes the loops
 * that use it (libm's expf is a call per element without -ffast-math): Cody-Waite reduction to
 * 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial (Cephes' coefficients). Below -87 it
 * returns e^-87. Shared by the native kernels (softmax numerators, SiLU). */
#ifndef LLMSERVE_FAST_EXP_H
#define LLMSERVE_FAST_EXP_H

#include <math.h>
#include <stdint.h>

static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

#endif
