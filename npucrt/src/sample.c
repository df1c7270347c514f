/* Choosing a token from a row of logits: greedy, or sampled under the OpenAI/vLLM
 * parameters (docs/serving.md lists them with their ranges).
 *
 * The row is processed in this order, each step on the previous one's result:
 *   1. logit_bias: bias_values[i] added to the logit of bias_ids[i];
 *      banned ids (min_tokens' end ids), and ids outside the allowed mask (a grammar's), set
 *      to -inf;
 *   2. repetition_penalty over the distinct ids of prompt and output (HF and vLLM: a
 *      positive logit divided by it, a negative one multiplied);
 *      frequency_penalty times each id's count in the output and presence_penalty once per
 *      distinct output id, subtracted (OpenAI);
 *   3. temperature 0: the first largest logit (greedy, as torch.argmax: a NaN is largest);
 *      else softmax(logits / temperature), then top_k, top_p over what top_k kept (the
 *      smallest set of the most likely ids whose mass reaches top_p of it), then min_p (ids
 *      below min_p times the largest probability dropped): HF's order of warpers.
 *   4. a draw from what is kept, renormalised.
 *
 * Reproducible: the draw's uniform number is a hash of (seed, the token's index in the
 * sequence's output), nothing else; the kept set and the order it is walked in are functions
 * of the row alone (ties broken by the lower id). So a sequence's tokens depend on its
 * logits and its seed, not on the slot it runs in, the requests beside it or the thread
 * that samples it. No state lives between calls.
 *
 * top_k and top_p need the most likely ids, not a sort: only the ids whose probability is at
 * least a bound are candidates (the bound lowered until they hold everything the filters
 * keep: top_k of them, or top_p of the mass); a radix selection (one counting pass over the
 * candidates, bucketed by their probability's top bits) and a quickselect-style partition of
 * the one bucket the boundary falls in leave the first k, then the first ones reaching
 * top_p's mass, at the front. The partitions are deterministic, so the kept set and the
 * order the draw walks it in are functions of the row alone. The exponentials are SIMD where the host has AVX2, so a draw
 * is reproducible on one host (and one build of the library), not across instruction sets.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "simd.h"

void npuc_sampling_default(npuc_sampling *p) {
    if (p == NULL) return;
    memset(p, 0, sizeof *p);
    p->struct_size = (uint32_t)sizeof *p;
    p->temperature = 0.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
}

static int bad(npuc_error *err, const char *field, const char *range, double value) {
    return rt_fail(err, NPUC_E_SAMPLING, range, "%s is %g", field, value);
}

int npuc_sampling_check(const npuc_sampling *p, int64_t vocab, npuc_error *err) {
    if (p == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    if (p->struct_size != sizeof *p)
        return rt_fail(err, NPUC_E_ARG, "initialise it with npuc_sampling_default", "npuc_sampling.struct_size is %u",
                       (unsigned)p->struct_size);
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return bad(err, "temperature", "temperature is 0 (greedy) or above", p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) return bad(err, "top_p", "top_p is in (0, 1]", p->top_p);
    if (p->top_k < 0) return bad(err, "top_k", "top_k is 0 (off) or above", p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) return bad(err, "min_p", "min_p is in [0, 1]", p->min_p);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return bad(err, "presence_penalty", "presence_penalty is in [-2, 2]", p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return bad(err, "frequency_penalty", "frequency_penalty is in [-2, 2]", p->frequency_penalty);
    if (!(p->repetition_penalty > 0.0f) || !isfinite(p->repetition_penalty))
        return bad(err, "repetition_penalty", "repetition_penalty is above 0 (1: off)", p->repetition_penalty);
    if (p->n_bias < 0 || (p->n_bias > 0 && (p->bias_ids == NULL || p->bias_values == NULL)))
        return rt_fail(err, NPUC_E_ARG, "", "logit_bias: %d entries and a NULL array", (int)p->n_bias);
    for (int32_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= vocab)
            return rt_fail(err, NPUC_E_SAMPLING, "logit_bias keys are token ids of the model",
                           "logit_bias names token id %lld; the vocabulary is 0..%lld", (long long)p->bias_ids[i],
                           (long long)vocab - 1);
        if (!(p->bias_values[i] >= -100.0f && p->bias_values[i] <= 100.0f))
            return rt_fail(err, NPUC_E_SAMPLING, "logit_bias values are in [-100, 100]",
                           "logit_bias gives token id %lld the value %g", (long long)p->bias_ids[i],
                           (double)p->bias_values[i]);
    }
    if (p->n_banned < 0 || (p->n_banned > 0 && p->banned == NULL))
        return rt_fail(err, NPUC_E_ARG, "", "banned: %d entries and a NULL array", (int)p->n_banned);
    if (p->n_allowed_words < 0 || (p->n_allowed_words > 0 && p->allowed == NULL))
        return rt_fail(err, NPUC_E_ARG, "", "allowed: %lld words and a NULL array", (long long)p->n_allowed_words);
    return NPUC_OK;
}

/* lg (a float a token), two candidate arrays (float + int32 each) and a byte a token. */
size_t npuc_sample_work_bytes(int64_t vocab) {
    if (vocab <= 0) return 0;
    return (size_t)vocab * (sizeof(float) + 2 * (sizeof(float) + sizeof(int32_t)) + 1);
}

/* splitmix64's finaliser: a 64-bit hash good enough to stand for a random stream. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double npuc_sample_uniform(uint64_t seed, int64_t index) {
    uint64_t z = mix64(seed + 0x9e3779b97f4a7c15ULL * ((uint64_t)index + 1));
    return (double)(z >> 11) * 0x1.0p-53;
}

/* The first largest value (a NaN is the largest, as torch.argmax). */
int64_t rt_argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

typedef struct {
    float p;
    int32_t id;
} cand;

/* The order of candidates: probability descending, then id ascending (a total order). */
static int before(cand a, cand b) { return a.p > b.p || (a.p == b.p && a.id < b.id); }

static void swap_cand(cand *a, cand *b) {
    cand t = *a;
    *a = *b, *b = t;
}

/* Partition [lo, hi) around a median-of-three pivot: the ones before it, then it (returned
 * index), then the ones after it. Deterministic: the result is a function of the input. */
static int64_t partition(cand *c, int64_t lo, int64_t hi) {
    int64_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (before(c[mid], c[lo])) swap_cand(&c[mid], &c[lo]);
    if (before(c[last], c[lo])) swap_cand(&c[last], &c[lo]);
    if (before(c[mid], c[last])) swap_cand(&c[mid], &c[last]); /* the median is at last now */
    int64_t i = lo;
    for (int64_t j = lo; j < last; j++)
        if (before(c[j], c[last])) swap_cand(&c[i++], &c[j]);
    swap_cand(&c[i], &c[last]);
    return i;
}

/* Leave the first k in the order in c[0, k) (in no particular order among themselves). */
static void select_first(cand *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        int64_t q = partition(c, lo, hi);
        if (q == k || q == k - 1) return;
        if (q < k) lo = q + 1;
        else hi = q;
    }
}

/* top_p: the smallest first-in-order set whose mass reaches lim (an id is kept while the mass
 * before it is below lim), left in c[0, m); returns m (at least 1). Expected O(n). */
static int64_t select_mass(cand *c, int64_t n, double lim) {
    int64_t lo = 0, hi = n;
    double acc = 0.0; /* the mass of c[0, lo): all before c[lo, hi) */
    while (hi > lo) {
        if (hi - lo == 1) return lo + 1;
        int64_t q = partition(c, lo, hi);
        double left = 0.0;
        for (int64_t i = lo; i < q; i++) left += c[i].p;
        if (acc + left >= lim) hi = q; /* the last kept one is before the pivot */
        else if (acc + left + c[q].p >= lim) return q + 1;
        else acc += left + c[q].p, lo = q + 1;
    }
    return lo > 0 ? lo : 1; /* rounding left the mass short of lim: everything up to here */
}

/* Radix selection: candidates bucketed by bits of their probability (a positive float's bits
 * order as it does), a counting pass a level: the top 11 bits (exponent and 3 mantissa bits,
 * 1/8 of an octave a bucket), then, where the boundary bucket is crowded (a flat
 * distribution), its next 11 bits. Only the final bucket the boundary falls in is
 * partitioned. */
enum { RADIX_BUCKETS = 2048, RADIX_CROWDED = 32 };

/* One level over c[0, n) on (bits >> shift) % RADIX_BUCKETS: the bucket where the count
 * reaches k (by_mass 0) or the mass reaches lim (by_mass 1). Writes into out the candidates
 * of the buckets above it (*above of them, *acc their mass), in array order, then its own
 * (*n_b). -1 where the mass falls short of lim (rounding). */
static int radix_level(const cand *c, int64_t n, int shift, int by_mass, int64_t k, double lim, cand *out,
                       int64_t *above, int64_t *n_b, double *acc) {
    /* two histograms, even and odd entries: a flat distribution puts runs of entries in one
     * bucket, and one histogram would chain every add on the one before */
    int32_t count2[2][RADIX_BUCKETS] = {{0}};
    double mass2[2][RADIX_BUCKETS] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &c[i].p, sizeof u);
        uint32_t key = (u >> shift) & (RADIX_BUCKETS - 1);
        count2[i & 1][key]++;
        if (by_mass) mass2[i & 1][key] += c[i].p;
    }
    int64_t count[RADIX_BUCKETS];
    double mass[RADIX_BUCKETS];
    for (int b = 0; b < RADIX_BUCKETS; b++)
        count[b] = (int64_t)count2[0][b] + count2[1][b], mass[b] = mass2[0][b] + mass2[1][b];
    int64_t up = 0;
    double m = 0.0;
    int b = RADIX_BUCKETS - 1;
    for (; b >= 0; b--) {
        if (by_mass ? m + mass[b] >= lim : up + count[b] >= k) break;
        up += count[b], m += mass[b];
    }
    if (b < 0) return -1;
    int64_t i_up = 0, i_b = up;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &c[i].p, sizeof u);
        int key = (int)((u >> shift) & (RADIX_BUCKETS - 1));
        if (key > b) out[i_up++] = c[i];
        else if (key == b) out[i_b++] = c[i];
    }
    *above = up, *n_b = count[b], *acc = m;
    return 0;
}

/* top_k: the first k (< n) in the order, left in c[0, k). tmp: n entries of scratch. */
static void radix_first(cand *c, int64_t n, int64_t k, cand *tmp) {
    int64_t above, nb, above2, nb2;
    double acc;
    radix_level(c, n, 20, 0, k, 0.0, tmp, &above, &nb, &acc); /* tmp: [above | boundary bucket] */
    if (nb > RADIX_CROWDED) {
        radix_level(tmp + above, nb, 9, 0, k - above, 0.0, c + above, &above2, &nb2, &acc);
        memcpy(c, tmp, (size_t)above * sizeof *c);
        select_first(c + above + above2, nb2, k - above - above2);
        return;
    }
    select_first(tmp + above, nb, k - above);
    memcpy(c, tmp, (size_t)k * sizeof *c);
}

/* top_p: the smallest first-in-order set whose mass reaches lim, left in c[0, m); returns m. */
static int64_t radix_mass(cand *c, int64_t n, double lim, cand *tmp) {
    int64_t above, nb, above2, nb2;
    double acc, acc2;
    if (radix_level(c, n, 20, 1, 0, lim, tmp, &above, &nb, &acc)) return n; /* short by rounding: all */
    if (nb > RADIX_CROWDED) {
        if (radix_level(tmp + above, nb, 9, 1, 0, lim - acc, c + above, &above2, &nb2, &acc2)) {
            memcpy(c, tmp, (size_t)(above + nb) * sizeof *c);
            return above + nb;
        }
        memcpy(c, tmp, (size_t)above * sizeof *c);
        return above + above2 + select_mass(c + above + above2, nb2, lim - acc - acc2);
    }
    int64_t m = above + select_mass(tmp + above, nb, lim - acc);
    memcpy(c, tmp, (size_t)m * sizeof *c);
    return m;
}

/* The largest value, NaN ignored (-inf where every value is NaN or -inf). */
static float max_of(const float *x, int64_t n) {
    float mx = -INFINITY;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + i), acc); /* a NaN lane keeps acc */
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++)
        if (lanes[l] > mx) mx = lanes[l];
#endif
    for (; i < n; i++)
        if (x[i] > mx) mx = x[i];
    return mx;
}

/* The sum of 16 floats (non-negative probabilities), as a float. */
static float sum16(const float *x) {
#if defined(__AVX2__) && defined(__FMA__)
    return npuc_hsum8(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)));
#else
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += x[l];
    return s;
#endif
}

/* x's sum, by chunks of 16 added in double. */
static double sum_of(const float *x, int64_t n) {
    double acc = 0.0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += sum16(x + i);
    for (; i < n; i++) acc += x[i];
    return acc;
}

/* The first index where the running sum of x exceeds target, skipping whole chunks of 16
 * (one dependent add each, not 16); where rounding leaves the sum short of target, the last
 * positive entry; -1 if none. */
static int64_t walk(const float *x, int64_t n, double target) {
    double acc = 0.0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        double s = sum16(x + i);
        if (acc + s > target) break;
        acc += s;
    }
    for (; i < n; i++) {
        acc += x[i];
        if (acc > target) return i;
    }
    for (int64_t j = n - 1; j >= 0; j--)
        if (x[j] > 0.0f) return j;
    return -1;
}

/* lg[i] = exp((lg[i] - mx) / T): probabilities relative to the largest; returns their sum. A
 * NaN logit counts 0. */
static double relative_softmax(float *lg, int64_t V, float mx, float inv_t) {
    double total = 0.0;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vmx = _mm256_set1_ps(mx), vt = _mm256_set1_ps(inv_t);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (; i + 8 <= V; i += 8) {
        __m256 e = npuc_exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(lg + i), vmx), vt));
        e = _mm256_and_ps(e, _mm256_cmp_ps(e, e, _CMP_ORD_Q)); /* NaN -> 0 */
        _mm256_storeu_ps(lg + i, e);
        acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double part[4];
    _mm256_storeu_pd(part, _mm256_add_pd(acc0, acc1));
    total = part[0] + part[1] + part[2] + part[3];
#endif
    for (; i < V; i++) {
        float e = expf((lg[i] - mx) * inv_t);
        if (isnan(e)) e = 0.0f;
        lg[i] = e, total += e;
    }
    return total;
}

/* Steps 1 and 2 above, in place. seen: vocab bytes of scratch. */
static void process(float *lg, int64_t V, const npuc_sampling *p, const int64_t *prompt, int32_t n_prompt,
                    const int64_t *out, int32_t n_out, unsigned char *seen) {
    for (int32_t i = 0; i < p->n_bias; i++) lg[p->bias_ids[i]] += p->bias_values[i];
    for (int32_t i = 0; i < p->n_banned; i++)
        if (p->banned[i] >= 0 && p->banned[i] < V) lg[p->banned[i]] = -INFINITY;
    if (p->n_allowed_words > 0)
        for (int64_t i = 0; i < V; i++)
            if (i / 32 >= p->n_allowed_words || !((p->allowed[i / 32] >> (i % 32)) & 1u)) lg[i] = -INFINITY;
    if (p->repetition_penalty != 1.0f) {
        memset(seen, 0, (size_t)V);
        for (int pass = 0; pass < 2; pass++) {
            const int64_t *t = pass ? out : prompt;
            int32_t n = pass ? n_out : n_prompt;
            for (int32_t i = 0; i < n; i++) {
                int64_t id = t[i];
                if (id < 0 || id >= V || seen[id]) continue;
                seen[id] = 1;
                lg[id] = lg[id] > 0 ? lg[id] / p->repetition_penalty : lg[id] * p->repetition_penalty;
            }
        }
    }
    if (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f) {
        memset(seen, 0, (size_t)V);
        for (int32_t i = 0; i < n_out; i++) {
            int64_t id = out[i];
            if (id < 0 || id >= V) continue;
            lg[id] -= p->frequency_penalty;
            if (!seen[id]) lg[id] -= p->presence_penalty, seen[id] = 1;
        }
    }
}

static int args_ok(const float *logits, int64_t vocab, const int64_t *prompt, int32_t n_prompt, const int64_t *out,
                   int32_t n_out, npuc_error *err) {
    if (logits == NULL || vocab <= 0 || vocab > INT32_MAX || n_prompt < 0 || n_out < 0 ||
        (n_prompt > 0 && prompt == NULL) || (n_out > 0 && out == NULL))
        return rt_fail(err, NPUC_E_ARG, "", "npuc_sample: a NULL or negative argument");
    return NPUC_OK;
}

int npuc_sampling_process(const float *logits, int64_t vocab, const npuc_sampling *p, const int64_t *prompt,
                          int32_t n_prompt, const int64_t *out, int32_t n_out, float *processed, npuc_error *err) {
    int rc = args_ok(logits, vocab, prompt, n_prompt, out, n_out, err);
    if (!rc && processed == NULL) rc = rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    if (!rc) rc = npuc_sampling_check(p, vocab, err);
    if (rc) return rc;
    unsigned char *seen = NULL;
    if (p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f) {
        seen = malloc((size_t)vocab);
        if (seen == NULL) return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    }
    memmove(processed, logits, (size_t)vocab * sizeof *processed);
    process(processed, vocab, p, prompt, n_prompt, out, n_out, seen);
    free(seen);
    return NPUC_OK;
}

/* The distribution npuc_sample draws from, in the work space: after the steps above, either
 * every id's unnormalised probability in lg[0..V) (no ordering needed; *ids NULL), or the kept
 * candidates' in lg[0..*m) with their ids in (*ids)[0..*m).mass of what is kept: *mass. Returns
 * -1 (and *greedy) where the choice is the greedy one: temperature 0, nothing allowed, NaN. */
static int kept(const float *logits, int64_t V, const npuc_sampling *p, const int64_t *prompt, int32_t n_prompt,
                const int64_t *out, int32_t n_out, void *work, int64_t *m_out, const cand **ids, int64_t *greedy) {
    float *lg = work;
    cand *cs = (cand *)(lg + V); /* V entries: float + int32 each */
    cand *tmp = cs + V;          /* V more: the radix selections' scratch */
    unsigned char *seen = (unsigned char *)(tmp + V);
    memcpy(lg, logits, (size_t)V * sizeof *lg);
    process(lg, V, p, prompt, n_prompt, out, n_out, seen);
    const float inv_t = p->temperature > 0.0f ? 1.0f / p->temperature : 0.0f;
    if (p->temperature == 0.0f || !isfinite(inv_t)) { /* greedy (a temperature too small to divide by is 0) */
        *greedy = rt_argmax(lg, V);
        return -1;
    }
    /* softmax(lg / T), unnormalised: probabilities relative to the largest (which is 1) */
    const float mx = max_of(lg, V);
    if (!(mx > -INFINITY) || isnan(mx)) { /* nothing allowed, or NaN logits: the greedy answer */
        *greedy = rt_argmax(lg, V);
        return -1;
    }
    const double total = relative_softmax(lg, V, mx, inv_t);
    const int64_t k = p->top_k > 0 && p->top_k < V ? p->top_k : 0;
    const float floor_p = p->min_p > 0.0f ? p->min_p : 0.0f; /* relative to the largest, which is 1 */
    *greedy = -1;
    if (k == 0 && p->top_p >= 1.0f) { /* no ordering needed: the ids in order */
        if (floor_p > 0.0f)
            for (int64_t i = 0; i < V; i++) lg[i] = lg[i] >= floor_p ? lg[i] : 0.0f;
        *m_out = V, *ids = NULL;
        return 0;
    }
    /* The candidates: every id at or above a bound, lowered until they hold what is kept. */
    int64_t n = 0;
    for (int it = 0;; it++) {
        const float bound = it < 15 ? ldexpf(1.0f, -8 * (it + 1)) : 0.0f; /* 2^-8, 2^-16, ... then all */
        double mass = 0.0;
        n = 0;
        for (int64_t i = 0; i < V; i++)
            if (lg[i] > 0.0f && lg[i] >= bound) cs[n].p = lg[i], cs[n].id = (int32_t)i, n++, mass += lg[i];
        /* every id below the bound is below every candidate, so the candidates are the most
         * likely n ids: enough when they include the top k, or (top_k off) reach top_p's mass */
        int enough = k ? n >= k : mass >= (double)p->top_p * total;
        /* with top_k off, ids below min_p's floor are dropped whatever top_p says */
        if (enough || bound == 0.0f || (!k && bound <= floor_p)) break;
    }
    /* top_k: the k first in the order, [0, m) after a selection (not a sort: O(n)) */
    int64_t m = n;
    if (k && k < n) radix_first(cs, n, k, tmp), m = k;
    double mass_k = 0.0;
    for (int64_t i = 0; i < m; i++) mass_k += cs[i].p;
    if (!k) mass_k = total; /* top_p is of the whole distribution when top_k is off */
    if (p->top_p < 1.0f) m = radix_mass(cs, m, (double)p->top_p * mass_k, tmp);
    int64_t j = 0; /* min_p */
    for (int64_t i = 0; i < m; i++)
        if (cs[i].p >= floor_p) cs[j++] = cs[i];
    m = j;
    for (int64_t i = 0; i < m; i++) lg[i] = cs[i].p; /* the kept ones, in the order the selections left them */
    *m_out = m, *ids = cs;
    return 0;
}

static int sample_args(const float *logits, int64_t vocab, const npuc_sampling *p, const int64_t *prompt,
                       int32_t n_prompt, const int64_t *out, int32_t n_out, const void *work, size_t work_bytes,
                       const void *result, npuc_error *err) {
    int rc = args_ok(logits, vocab, prompt, n_prompt, out, n_out, err);
    if (!rc && result == NULL) rc = rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    if (rc || p == NULL) return rc;
    rc = npuc_sampling_check(p, vocab, err);
    if (rc) return rc;
    if (work == NULL || work_bytes < npuc_sample_work_bytes(vocab))
        return rt_fail(err, NPUC_E_ARG, "size it with npuc_sample_work_bytes",
                       "npuc_sample: %zu bytes of work space; it needs %zu", work_bytes, npuc_sample_work_bytes(vocab));
    return NPUC_OK;
}

int npuc_sample(const float *logits, int64_t vocab, const npuc_sampling *p, const int64_t *prompt, int32_t n_prompt,
                const int64_t *out, int32_t n_out, void *work, size_t work_bytes, int64_t *token, npuc_error *err) {
    int rc = sample_args(logits, vocab, p, prompt, n_prompt, out, n_out, work, work_bytes, token, err);
    if (rc) return rc;
    if (p == NULL) { /* greedy on the row as it is */
        *token = rt_argmax(logits, vocab);
        return NPUC_OK;
    }
    int64_t m = 0, greedy = -1;
    const cand *ids = NULL;
    if (kept(logits, vocab, p, prompt, n_prompt, out, n_out, work, &m, &ids, &greedy) < 0) {
        *token = greedy;
        return NPUC_OK;
    }
    float *lg = work;
    const double u = npuc_sample_uniform(p->seed, n_out);
    int64_t at = walk(lg, m, u * sum_of(lg, m));
    *token = at < 0 ? rt_argmax(logits, vocab) : ids != NULL ? ids[at].id : at;
    return NPUC_OK;
}

int npuc_sample_probs(const float *logits, int64_t vocab, const npuc_sampling *p, const int64_t *prompt,
                      int32_t n_prompt, const int64_t *out, int32_t n_out, void *work, size_t work_bytes,
                      float *probs, npuc_error *err) {
    int rc = sample_args(logits, vocab, p, prompt, n_prompt, out, n_out, work, work_bytes, probs, err);
    if (rc) return rc;
    int64_t m = 0, greedy = -1;
    const cand *ids = NULL;
    memset(probs, 0, (size_t)vocab * sizeof *probs);
    if (p == NULL) greedy = rt_argmax(logits, vocab);
    else if (kept(logits, vocab, p, prompt, n_prompt, out, n_out, work, &m, &ids, &greedy) == 0) {
        const float *lg = work;
        const double total = sum_of(lg, m);
        if (total > 0.0) {
            for (int64_t i = 0; i < m; i++) probs[ids != NULL ? ids[i].id : i] = (float)(lg[i] / total);
            return NPUC_OK;
        }
        greedy = rt_argmax(logits, vocab); /* nothing kept: npuc_sample's answer */
    }
    probs[greedy] = 1.0f;
    return NPUC_OK;
}
