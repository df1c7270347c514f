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
 * top_k and top_p need the most likely ids in order, but not a sort of the whole vocabulary:
 * only the ids whose probability is at least a bound are sorted, the bound lowered until
 * those ids hold everything the filters keep (top_k of them, or top_p of the mass).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

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

size_t npuc_sample_work_bytes(int64_t vocab) {
    if (vocab <= 0) return 0;
    return (size_t)vocab * (sizeof(float) * 2 + sizeof(int32_t) + 1);
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

/* Sort order of candidates: probability descending, then id ascending. */
static int by_prob(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
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

int npuc_sample(const float *logits, int64_t vocab, const npuc_sampling *p, const int64_t *prompt, int32_t n_prompt,
                const int64_t *out, int32_t n_out, void *work, size_t work_bytes, int64_t *token, npuc_error *err) {
    int rc = args_ok(logits, vocab, prompt, n_prompt, out, n_out, err);
    if (!rc && token == NULL) rc = rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    if (rc) return rc;
    if (p == NULL) { /* greedy on the row as it is */
        *token = rt_argmax(logits, vocab);
        return NPUC_OK;
    }
    rc = npuc_sampling_check(p, vocab, err);
    if (rc) return rc;
    if (work == NULL || work_bytes < npuc_sample_work_bytes(vocab))
        return rt_fail(err, NPUC_E_ARG, "size it with npuc_sample_work_bytes",
                       "npuc_sample: %zu bytes of work space; it needs %zu", work_bytes, npuc_sample_work_bytes(vocab));
    const int64_t V = vocab;
    float *lg = work;
    cand *cs = (cand *)(lg + V); /* V entries: float + int32 each */
    unsigned char *seen = (unsigned char *)(cs + V);
    memcpy(lg, logits, (size_t)V * sizeof *lg);
    process(lg, V, p, prompt, n_prompt, out, n_out, seen);
    const float inv_t = p->temperature > 0.0f ? 1.0f / p->temperature : 0.0f;
    if (p->temperature == 0.0f || !isfinite(inv_t)) { /* greedy (a temperature too small to divide by is 0) */
        *token = rt_argmax(lg, V);
        return NPUC_OK;
    }
    /* softmax(lg / T), unnormalised: probabilities relative to the largest (which is 1) */
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        if (lg[i] > mx) mx = lg[i];
    if (!(mx > -INFINITY) || isnan(mx)) { /* nothing allowed, or NaN logits: the greedy answer */
        *token = rt_argmax(lg, V);
        return NPUC_OK;
    }
    double total = 0.0;
    for (int64_t i = 0; i < V; i++) {
        float e = expf((lg[i] - mx) * inv_t);
        if (isnan(e)) e = 0.0f;
        lg[i] = e, total += e;
    }
    const double u = npuc_sample_uniform(p->seed, n_out);
    const int64_t k = p->top_k > 0 && p->top_k < V ? p->top_k : 0;
    const float floor_p = p->min_p > 0.0f ? p->min_p : 0.0f; /* relative to the largest, which is 1 */
    if (k == 0 && p->top_p >= 1.0f) { /* no ordering needed: walk the ids in order */
        double kept = 0.0;
        for (int64_t i = 0; i < V; i++)
            if (lg[i] > 0.0f && lg[i] >= floor_p) kept += lg[i];
        double target = u * kept, acc = 0.0;
        int64_t last = -1;
        for (int64_t i = 0; i < V; i++) {
            if (!(lg[i] > 0.0f && lg[i] >= floor_p)) continue;
            acc += lg[i], last = i;
            if (acc > target) break;
        }
        *token = last >= 0 ? last : rt_argmax(logits, V);
        return NPUC_OK;
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
    qsort(cs, (size_t)n, sizeof *cs, by_prob);
    int64_t m = k && k < n ? k : n; /* top_k */
    double mass_k = 0.0;
    for (int64_t i = 0; i < m; i++) mass_k += cs[i].p;
    if (!k) mass_k = total; /* top_p is of the whole distribution when top_k is off */
    if (p->top_p < 1.0f) { /* keep an id while the mass before it is below top_p */
        double before = 0.0, lim = (double)p->top_p * mass_k;
        int64_t j = 0;
        while (j < m && (j == 0 || before < lim)) before += cs[j].p, j++;
        m = j;
    }
    while (m > 1 && cs[m - 1].p < floor_p) m--; /* min_p: sorted, so the dropped ones are last */
    double kept = 0.0;
    for (int64_t i = 0; i < m; i++) kept += cs[i].p;
    double target = u * kept, acc = 0.0;
    int64_t pick = m > 0 ? cs[m - 1].id : rt_argmax(logits, V);
    for (int64_t i = 0; i < m; i++) {
        acc += cs[i].p;
        if (acc > target) {
            pick = cs[i].id;
            break;
        }
    }
    *token = pick;
    return NPUC_OK;
}
