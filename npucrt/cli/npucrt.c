/* npucrt: run a `.om` from the command line with libnpucrt alone (no Python).
 *
 *   npucrt info MODEL.om
 *   npucrt run MODEL.om [--program NAME] --input NAME=FILE.npy ... [--output-dir DIR] [--threads T]
 *   npucrt generate MODEL.om --prompt-ids 1,2,3 [--prompt-ids ...] [--max-new-tokens N] [--ignore-eos]
 *                  [--threads T] [--timing] [--temperature F --top-p F --top-k N --min-p F --seed N
 *                  --repetition-penalty F --presence-penalty F --frequency-penalty F]
 *                  [--speculative ngram|off] [--ngram-min N] [--ngram-max N]
 *
 * Built on include/npucrt.h only: it doubles as an example of the API. Its output and its
 * errors are `npuc`'s (cli/main.py): `generate` prints the same tokens in the same form, and a
 * mistake prints `npucrt: error NPUC-Exxxx: message` and `  hint: ...` and exits 2 (usage),
 * 4 (a file) or 1.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, fileno, mkdir under -std=c11 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "npucrt.h"

#ifndef NPUCRT_VERSION_STRING
#define NPUCRT_VERSION_STRING "unknown"
#endif

#define E_USAGE 100    /* the command line does not parse */
#define E_BAD_INPUT 110 /* a malformed --input NAME=FILE.npy */
#define E_WRITE 406    /* an output cannot be written */

/* ---- errors ------------------------------------------------------------------------------ */

static int exit_code_of(int code) {
    if (code >= 100 && code < 200) {
        return 2;
    }
    if (code >= 400 && code < 500) {
        return 4;
    }
    return 1;
}

/* Print the error as npuc does and return the exit code that goes with it. */
static int report(int code, const char *hint, const char *fmt, ...) {
    char name[32];
    if (npuc_code_string(code, name, sizeof name) != NPUC_OK) {
        snprintf(name, sizeof name, "NPUC-E%04d", code);
    }
    fprintf(stderr, "npucrt: error %s: ", name);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (hint != NULL && hint[0] != '\0') {
        fprintf(stderr, "  hint: %s\n", hint);
    }
    return exit_code_of(code);
}

/* A library call's failure: its message where it gave one. */
static int report_lib(int status, const npuc_error *err, const char *what) {
    if (err != NULL && err->message[0] != '\0') {
        return report(status, err->hint, "%s", err->message);
    }
    return report(status, NULL, "%s failed", what);
}

static int usage_error(const char *command, const char *fmt, const char *arg) {
    char hint[96];
    snprintf(hint, sizeof hint, "see `npucrt%s%s --help`", command ? " " : "", command ? command : "");
    return report(E_USAGE, hint, fmt, arg);
}

/* ---- small helpers ----------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *dtype_name(npuc_dtype d) {
    static const char *const names[] = {"f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool"};
    return (unsigned)d < sizeof names / sizeof names[0] ? names[d] : "?";
}

static int dtype_is_float(npuc_dtype d) {
    return d == NPUC_F64 || d == NPUC_F32 || d == NPUC_F16 || d == NPUC_BF16;
}

static size_t dtype_size(npuc_dtype d) {
    switch (d) {
    case NPUC_F64: case NPUC_I64: return 8;
    case NPUC_F32: case NPUC_I32: return 4;
    case NPUC_F16: case NPUC_BF16: case NPUC_I16: return 2;
    default: return 1;
    }
}

/* "i64[1,32]" */
static void format_tensor(const npuc_tensor_info *t, char *buf, size_t size) {
    int n = snprintf(buf, size, "%s: %s[", t->name, dtype_name(t->dtype));
    for (int32_t i = 0; i < t->rank && n >= 0 && (size_t)n < size; i++) {
        n += snprintf(buf + n, size - (size_t)n, i ? ",%" PRId64 : "%" PRId64, t->shape[i]);
    }
    if (n >= 0 && (size_t)n < size) {
        snprintf(buf + n, size - (size_t)n, "]");
    }
}

/* 152064 -> "152,064" */
static const char *with_commas(uint64_t v, char buf[32]) {
    char digits[24];
    int n = snprintf(digits, sizeof digits, "%" PRIu64, v), o = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && (n - i) % 3 == 0) {
            buf[o++] = ',';
        }
        buf[o++] = digits[i];
    }
    buf[o] = '\0';
    return buf;
}

/* A decimal in [lo, hi] (an optional '-', then digits only); 0 if `s` is one. */
static int parse_int(const char *s, long long lo, long long hi, long long *out) {
    const char *d = s[0] == '-' ? s + 1 : s;
    if (*d < '0' || *d > '9') { /* strtoll would skip spaces and take a '+' */
        return -1;
    }
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < lo || v > hi) {
        return -1;
    }
    *out = v;
    return 0;
}

/* A finite decimal number (strtod's syntax, the whole string); 0 if `s` is one. */
static int parse_float(const char *s, float *out) {
    if (s[0] == '\0' || s[0] == ' ' || s[0] == '\t') {
        return -1;
    }
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || !isfinite(v)) {
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* Reads the whole file: 0, or NPUC_E_OPEN with errno's reason in `why`. */
static int read_file(const char *path, unsigned char **data, size_t *size, const char **why) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        *why = strerror(errno);
        return NPUC_E_OPEN;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        *why = strerror(errno);
        fclose(f);
        return NPUC_E_OPEN;
    }
    if (!S_ISREG(st.st_mode)) { /* a directory opens, and a pipe has no size to read */
        *why = S_ISDIR(st.st_mode) ? "it is a directory" : "it is not a regular file";
        fclose(f);
        return NPUC_E_OPEN;
    }
    size_t n = (size_t)st.st_size;
    unsigned char *buf = malloc(n ? n : 1);
    if (buf == NULL) {
        *why = "out of memory";
        fclose(f);
        return NPUC_E_OPEN;
    }
    if (fread(buf, 1, n, f) != n) {
        *why = ferror(f) ? strerror(errno) : "the file changed while it was read";
        free(buf);
        fclose(f);
        return NPUC_E_OPEN;
    }
    fclose(f);
    *data = buf;
    *size = n;
    return 0;
}

/* ---- .npy --------------------------------------------------------------------------------- */

/* The dtypes read and written. bf16 is no numpy dtype: a bf16 input takes <u2 (its bits) or any
 * float array, and a bf16 output is written as <f4 (exact). */
typedef enum { NPY_F8, NPY_F4, NPY_F2, NPY_I8, NPY_I4, NPY_I2, NPY_I1, NPY_U1, NPY_U2, NPY_B1 } npy_kind;
static const struct {
    const char *descr;
    size_t size;
} npy_types[] = {{"<f8", 8}, {"<f4", 4}, {"<f2", 2}, {"<i8", 8}, {"<i4", 4}, {"<i2", 2}, {"|i1", 1},
                 {"|u1", 1}, {"<u2", 2}, {"|b1", 1}};

typedef struct npy_array {
    npy_kind kind;
    int32_t rank;
    int64_t shape[NPUC_MAX_RANK];
    uint64_t count;
    const unsigned char *data;
} npy_array;

typedef struct npy_parser {
    const char *p, *end;
    char why[160];
} npy_parser;

static void skip_space(npy_parser *ps) {
    while (ps->p < ps->end && *ps->p == ' ') {
        ps->p++;
    }
}

static int expect(npy_parser *ps, char c) {
    skip_space(ps);
    if (ps->p >= ps->end || *ps->p != c) {
        snprintf(ps->why, sizeof ps->why, "its header has no '%c' where one belongs", c);
        return -1;
    }
    ps->p++;
    return 0;
}

/* A quoted Python string literal without escapes, into buf. */
static int parse_str(npy_parser *ps, char *buf, size_t size) {
    skip_space(ps);
    if (ps->p >= ps->end || (*ps->p != '\'' && *ps->p != '"')) {
        snprintf(ps->why, sizeof ps->why, "its header holds no string where one belongs");
        return -1;
    }
    char q = *ps->p++;
    size_t n = 0;
    while (ps->p < ps->end && *ps->p != q) {
        if (*ps->p == '\\' || n + 1 >= size) {
            snprintf(ps->why, sizeof ps->why, "its header holds a string that is not a dtype or key");
            return -1;
        }
        buf[n++] = *ps->p++;
    }
    if (ps->p >= ps->end) {
        snprintf(ps->why, sizeof ps->why, "its header has an unterminated string");
        return -1;
    }
    ps->p++;
    buf[n] = '\0';
    return 0;
}

static int parse_shape(npy_parser *ps, npy_array *a) {
    if (expect(ps, '(') != 0) {
        return -1;
    }
    a->rank = 0;
    for (;;) {
        skip_space(ps);
        if (ps->p < ps->end && *ps->p == ')') {
            ps->p++;
            break;
        }
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') {
            snprintf(ps->why, sizeof ps->why, "its shape is not a tuple of non-negative integers");
            return -1;
        }
        int64_t d = 0;
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
            if (d > (INT64_MAX - 9) / 10) {
                snprintf(ps->why, sizeof ps->why, "its shape has a dim too large");
                return -1;
            }
            d = d * 10 + (*ps->p++ - '0');
        }
        if (a->rank >= NPUC_MAX_RANK) {
            snprintf(ps->why, sizeof ps->why, "its shape has more than %d dims", NPUC_MAX_RANK);
            return -1;
        }
        a->shape[a->rank++] = d;
        skip_space(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
        } else if (ps->p < ps->end && *ps->p == ')') {
            if (a->rank == 1) { /* (5) is an int in Python, not a tuple */
                snprintf(ps->why, sizeof ps->why, "its shape is not a tuple");
                return -1;
            }
            ps->p++;
            break;
        } else {
            snprintf(ps->why, sizeof ps->why, "its shape is not a tuple of non-negative integers");
            return -1;
        }
    }
    return 0;
}

/* Parses a .npy held in memory; every field is checked, nothing is read past `size`.
 * 0, or -1 with the reason in `why`. */
static int npy_parse(const unsigned char *buf, size_t size, npy_array *a, char *why, size_t why_size) {
    static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    npy_parser ps = {0};
    memset(a, 0, sizeof *a);
    if (size < 10 || memcmp(buf, magic, 6) != 0) {
        snprintf(why, why_size, "it is not a .npy file (no \\x93NUMPY magic)");
        return -1;
    }
    if ((buf[6] != 1 && buf[6] != 2) || buf[7] != 0) {
        snprintf(why, why_size, "its .npy format version %u.%u is not 1.0 or 2.0", buf[6], buf[7]);
        return -1;
    }
    size_t start, hlen;
    if (buf[6] == 1) {
        start = 10;
        hlen = (size_t)buf[8] | (size_t)buf[9] << 8;
    } else {
        if (size < 12) {
            snprintf(why, why_size, "it is truncated in its header");
            return -1;
        }
        start = 12;
        hlen = (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    }
    if (hlen > size - start || hlen == 0) {
        snprintf(why, why_size, "it is truncated in its header");
        return -1;
    }
    for (size_t i = 0; i < hlen; i++) {
        unsigned char c = buf[start + i];
        if ((c < 0x20 || c > 0x7e) && !(c == '\n' && i == hlen - 1)) {
            snprintf(why, why_size, "its header is not one line of printable ASCII");
            return -1;
        }
    }
    if (buf[start + hlen - 1] != '\n') {
        snprintf(why, why_size, "its header does not end with a newline");
        return -1;
    }
    ps.p = (const char *)buf + start;
    ps.end = ps.p + hlen - 1;
    int seen_descr = 0, seen_order = 0, seen_shape = 0;
    if (expect(&ps, '{') != 0) {
        goto bad;
    }
    for (;;) {
        skip_space(&ps);
        if (ps.p < ps.end && *ps.p == '}') {
            ps.p++;
            break;
        }
        char key[32], val[32];
        if (parse_str(&ps, key, sizeof key) != 0 || expect(&ps, ':') != 0) {
            goto bad;
        }
        if (strcmp(key, "descr") == 0 && !seen_descr) {
            seen_descr = 1;
            if (parse_str(&ps, val, sizeof val) != 0) {
                goto bad;
            }
            size_t k = 0, n = sizeof npy_types / sizeof npy_types[0];
            while (k < n && strcmp(val, npy_types[k].descr) != 0) {
                k++;
            }
            if (k == n) {
                snprintf(why, why_size, "its dtype '%s' is not one npucrt reads "
                         "(<f8 <f4 <f2 <i8 <i4 <i2 |i1 |u1 <u2 |b1, little-endian)", val);
                return -1;
            }
            a->kind = (npy_kind)k;
        } else if (strcmp(key, "fortran_order") == 0 && !seen_order) {
            seen_order = 1;
            skip_space(&ps);
            if ((size_t)(ps.end - ps.p) >= 5 && memcmp(ps.p, "False", 5) == 0) {
                ps.p += 5;
            } else if ((size_t)(ps.end - ps.p) >= 4 && memcmp(ps.p, "True", 4) == 0) {
                snprintf(why, why_size, "it is in Fortran order; save a C-ordered array "
                         "(numpy.ascontiguousarray)");
                return -1;
            } else {
                snprintf(ps.why, sizeof ps.why, "its fortran_order is not True or False");
                goto bad;
            }
        } else if (strcmp(key, "shape") == 0 && !seen_shape) {
            seen_shape = 1;
            if (parse_shape(&ps, a) != 0) {
                goto bad;
            }
        } else {
            snprintf(ps.why, sizeof ps.why, "its header has an unknown or repeated key '%s'", key);
            goto bad;
        }
        skip_space(&ps);
        if (ps.p < ps.end && *ps.p == ',') {
            ps.p++;
        } else if (!(ps.p < ps.end && *ps.p == '}')) {
            snprintf(ps.why, sizeof ps.why, "its header is not a dict");
            goto bad;
        }
    }
    skip_space(&ps);
    if (ps.p != ps.end) {
        snprintf(ps.why, sizeof ps.why, "its header has bytes after the dict");
        goto bad;
    }
    if (!seen_descr || !seen_order || !seen_shape) {
        snprintf(ps.why, sizeof ps.why, "its header lacks '%s'",
                 !seen_descr ? "descr" : !seen_order ? "fortran_order" : "shape");
        goto bad;
    }
    uint64_t count = 1, avail = size - start - hlen, item = npy_types[a->kind].size;
    for (int32_t i = 0; i < a->rank; i++) {
        if (a->shape[i] != 0 && count > UINT64_MAX / item / (uint64_t)a->shape[i]) {
            snprintf(why, why_size, "its shape is too large");
            return -1;
        }
        count *= (uint64_t)a->shape[i];
    }
    if (count * item != avail) {
        snprintf(why, why_size, "it holds %" PRIu64 " bytes of data, its header says %" PRIu64, avail, count * item);
        return -1;
    }
    a->count = count;
    a->data = buf + start + hlen;
    if (a->kind == NPY_B1) {
        for (uint64_t i = 0; i < count; i++) {
            if (a->data[i] > 1) {
                snprintf(why, why_size, "its bool element %" PRIu64 " is neither 0 nor 1", i);
                return -1;
            }
        }
    }
    return 0;
bad:
    snprintf(why, why_size, "%s", ps.why[0] ? ps.why : "its header does not parse");
    return -1;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) | 0x40); /* a quiet NaN */
    }
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16); /* round to nearest even */
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) {
        return sign | 0x7e00;
    }
    if (abs >= 0x477ff000u) { /* rounds to 65536 or more: infinity */
        return sign | 0x7c00;
    }
    if (abs < 0x38800000u) { /* a subnormal half (or zero): scale, then round to nearest even */
        float a;
        memcpy(&a, &abs, 4);
        return sign | (uint16_t)lrintf(a * 16777216.0f);
    }
    uint32_t r = abs + 0xfffu + ((abs >> 13) & 1) - 0x38000000u;
    return sign | (uint16_t)(r >> 13);
}

static double f16_to_f64(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m | 0x400, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* Element i of an array as a double or an int64 (per its kind). */
static double npy_get_f(const npy_array *a, uint64_t i) {
    const unsigned char *p = a->data + i * npy_types[a->kind].size;
    if (a->kind == NPY_F8) {
        double v;
        memcpy(&v, p, 8);
        return v;
    }
    if (a->kind == NPY_F4) {
        float v;
        memcpy(&v, p, 4);
        return v;
    }
    return f16_to_f64((uint16_t)(p[0] | p[1] << 8));
}

static int64_t npy_get_i(const npy_array *a, uint64_t i) {
    const unsigned char *p = a->data + i * npy_types[a->kind].size;
    switch (a->kind) {
    case NPY_I8: { int64_t v; memcpy(&v, p, 8); return v; }
    case NPY_I4: { int32_t v; memcpy(&v, p, 4); return v; }
    case NPY_I2: { int16_t v; memcpy(&v, p, 2); return v; }
    case NPY_U2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case NPY_I1: return (int8_t)p[0];
    default: return p[0]; /* u1, b1 */
    }
}

/* Converts a parsed array into the model input's dtype, as `npuc run` casts (floats to any
 * float dtype, integers and bools to any integer or bool dtype); an integer that does not fit
 * is refused rather than wrapped. 0, or -1 with the reason in `why`. */
static int npy_convert(const npy_array *a, npuc_dtype to, void *out, char *why, size_t why_size) {
    int from_float = a->kind == NPY_F8 || a->kind == NPY_F4 || a->kind == NPY_F2;
    if (to == NPUC_BF16 && a->kind == NPY_U2) { /* bf16's bits, as stored */
        memcpy(out, a->data, a->count * 2);
        return 0;
    }
    if (from_float != dtype_is_float(to)) {
        snprintf(why, why_size, "has dtype %s, the model expects %s", npy_types[a->kind].descr, dtype_name(to));
        return -1;
    }
    for (uint64_t i = 0; i < a->count; i++) {
        if (from_float) {
            double v = npy_get_f(a, i);
            switch (to) {
            case NPUC_F64: ((double *)out)[i] = v; break;
            case NPUC_F32: ((float *)out)[i] = (float)v; break;
            case NPUC_F16: ((uint16_t *)out)[i] = f32_to_f16((float)v); break;
            default: ((uint16_t *)out)[i] = f32_to_bf16((float)v); break;
            }
            continue;
        }
        int64_t v = npy_get_i(a, i);
        static const int64_t lo[] = {[NPUC_I64] = INT64_MIN, [NPUC_I32] = INT32_MIN, [NPUC_I16] = INT16_MIN,
                                     [NPUC_I8] = INT8_MIN, [NPUC_U8] = 0, [NPUC_BOOL] = 0};
        static const int64_t hi[] = {[NPUC_I64] = INT64_MAX, [NPUC_I32] = INT32_MAX, [NPUC_I16] = INT16_MAX,
                                     [NPUC_I8] = INT8_MAX, [NPUC_U8] = UINT8_MAX, [NPUC_BOOL] = 1};
        if (v < lo[to] || v > hi[to]) {
            snprintf(why, why_size, "holds %" PRId64 " (element %" PRIu64 "), outside %s's range", v, i,
                     dtype_name(to));
            return -1;
        }
        switch (to) {
        case NPUC_I64: ((int64_t *)out)[i] = v; break;
        case NPUC_I32: ((int32_t *)out)[i] = (int32_t)v; break;
        case NPUC_I16: ((int16_t *)out)[i] = (int16_t)v; break;
        case NPUC_I8: ((int8_t *)out)[i] = (int8_t)v; break;
        default: ((uint8_t *)out)[i] = (uint8_t)v; break; /* u8, bool */
        }
    }
    return 0;
}

/* Writes a tensor as a .npy (format 1.0, its header padded to 64 bytes as numpy does). */
static int npy_write(const char *path, const npuc_tensor_info *t, const void *data) {
    npuc_dtype d = t->dtype;
    const char *descr = d == NPUC_F64 ? "<f8" : d == NPUC_F32 || d == NPUC_BF16 ? "<f4" : d == NPUC_F16 ? "<f2"
                      : d == NPUC_I64 ? "<i8" : d == NPUC_I32 ? "<i4" : d == NPUC_I16 ? "<i2"
                      : d == NPUC_I8 ? "|i1" : d == NPUC_U8 ? "|u1" : "|b1";
    char header[512]; /* the dict is under 256 bytes for NPUC_MAX_RANK dims of 19 digits */
    int n = snprintf(header + 10, sizeof header - 10, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
    for (int32_t i = 0; i < t->rank; i++) {
        n += snprintf(header + 10 + n, sizeof header - 10 - (size_t)n, "%" PRId64 "%s", t->shape[i],
                      t->rank == 1 || i + 1 < t->rank ? ", " : "");
    }
    n += snprintf(header + 10 + n, sizeof header - 10 - (size_t)n, "), }");
    if (t->rank == 1) { /* "(5, )" -> "(5,)" as numpy writes it */
        char *c = strstr(header + 10, ", ), }");
        if (c != NULL) {
            memmove(c + 1, c + 2, strlen(c + 2) + 1);
            n--;
        }
    }
    size_t total = (10 + (size_t)n + 1 + 63) / 64 * 64, hlen = total - 10;
    memset(header + 10 + n, ' ', hlen - (size_t)n - 1);
    header[total - 1] = '\n';
    memcpy(header, "\x93NUMPY\x01\x00", 8);
    header[8] = (char)(hlen & 0xff);
    header[9] = (char)(hlen >> 8);

    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        return -1;
    }
    int ok = fwrite(header, 1, total, f) == total;
    if (d == NPUC_BF16) {
        const uint16_t *h = data;
        for (uint64_t i = 0; ok && i < t->nbytes / 2; i++) {
            float v = bf16_to_f32(h[i]);
            ok = fwrite(&v, 4, 1, f) == 1;
        }
    } else if (t->nbytes > 0) {
        ok = ok && fwrite(data, 1, t->nbytes, f) == t->nbytes;
    }
    ok = (fclose(f) == 0) && ok;
    return ok ? 0 : -1;
}

/* ---- the model --------------------------------------------------------------------------- */

static int load_model(const char *path, int verify, npuc_model **m) {
    npuc_error err = {0};
    npuc_load_options opts;
    npuc_load_options_default(&opts);
    opts.verify_checksums = verify;
    int rc = npuc_model_load_file(path, &opts, m, &err);
    return rc == NPUC_OK ? 0 : report_lib(rc, &err, "loading the model");
}

static int make_session(const npuc_model *m, int threads, npuc_session **s) {
    npuc_error err = {0};
    npuc_session_options opts;
    npuc_session_options_default(&opts);
    opts.threads = threads;
    int rc = npuc_session_create(m, &opts, s, &err);
    return rc == NPUC_OK ? 0 : report_lib(rc, &err, "creating a session");
}

/* "prefill, decode" */
static void program_names(const npuc_model *m, char *buf, size_t size) {
    int32_t n = 0;
    size_t o = 0;
    buf[0] = '\0';
    npuc_model_program_count(m, &n);
    for (int32_t p = 0; p < n && o < size; p++) {
        const char *name = "?";
        npuc_model_program_name(m, p, &name);
        o += (size_t)snprintf(buf + o, size - o, "%s%s", p ? ", " : "", name);
    }
}

static int cmd_info(const char *path) {
    npuc_model *m = NULL;
    int rc = load_model(path, 1, &m);
    if (rc != 0) {
        return rc;
    }
    char c1[32], c2[32], c3[32], line[2048];
    const char *producer = NULL;
    printf("file         %s\n", path);
    if (npuc_model_metadata(m, "compiler", &producer) == NPUC_OK) {
        printf("producer     %s\n", producer);
    }
    int32_t n_prog = 0;
    npuc_model_program_count(m, &n_prog);
    for (int32_t p = 0; p < n_prog; p++) {
        const char *name = "?";
        int32_t n_in = 0, n_out = 0;
        npuc_model_program_name(m, p, &name);
        npuc_model_input_count(m, p, &n_in);
        npuc_model_output_count(m, p, &n_out);
        printf("program      %s\n", name);
        for (int io = 0; io < 2; io++) {
            printf("  %s", io == 0 ? "inputs     " : "outputs    ");
            for (int32_t i = 0; i < (io == 0 ? n_in : n_out); i++) {
                npuc_tensor_info t;
                if ((io == 0 ? npuc_model_input(m, p, i, &t) : npuc_model_output(m, p, i, &t)) != NPUC_OK) {
                    continue;
                }
                format_tensor(&t, line, sizeof line);
                printf("%s%s", i ? ", " : "", line);
            }
            printf("\n");
        }
    }
    uint64_t arena = 0, state = 0, weights = 0;
    npuc_model_memory(m, &arena, &state, &weights);
    printf("arena        %s B\nstate        %s B\nweights      %s B\n", with_commas(arena, c1),
           with_commas(state, c2), with_commas(weights, c3));
    npuc_generation_info g;
    npuc_error err = {0};
    rc = npuc_model_generation_info(m, &g, &err);
    if (rc == NPUC_OK) {
        printf("generation   slots %" PRId32 ", max_seq_len %" PRId32 ", prefill_len %" PRId32
               ", decode_tokens %" PRId32 ", vocab %" PRId64 ", logits %" PRId64 "\n",
               g.slots, g.max_seq_len, g.prefill_len, g.decode_tokens, g.vocab, g.logits_width);
        printf("eos          ");
        for (int32_t i = 0; i < g.n_eos; i++) {
            printf("%s%" PRId64, i ? ", " : "", g.eos[i]);
        }
        printf("%s\n", g.n_eos ? "" : "none");
        rc = 0;
    } else if (rc == NPUC_E_NO_PROGRAM) {
        printf("generation   none (no prefill and decode programs)\n");
        rc = 0;
    } else {
        rc = report_lib(rc, &err, "reading the generation info");
    }
    npuc_model_free(m);
    return rc;
}

/* ---- run ---------------------------------------------------------------------------------- */

typedef struct input_arg {
    const char *name, *path;
} input_arg;

static int make_dirs(const char *dir) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0777) != 0 && errno != EEXIST) {
                return -1;
            }
            *p = c;
            if (c == '\0') {
                break;
            }
        }
    }
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

/* Reads input `t` from the .npy `file` into a new buffer of t->nbytes, as the model's dtype.
 * 0, or an exit code after the error is printed. */
static int read_input(const npuc_tensor_info *t, const char *file, void **out) {
    unsigned char *data = NULL;
    size_t size = 0;
    const char *reason = "";
    char why[256], shape[1024];
    npy_array a;
    if (read_file(file, &data, &size, &reason) != 0) {
        return report(NPUC_E_OPEN, "inputs are .npy files written by numpy.save",
                      "cannot read input '%s' from '%s': %s", t->name, file, reason);
    }
    int rc = 0;
    if (npy_parse(data, size, &a, why, sizeof why) != 0) {
        rc = report(NPUC_E_INPUT, "inputs are .npy files written by numpy.save (little-endian, C order)",
                    "input '%s': '%s' is not a valid .npy: %s", t->name, file, why);
    } else if (a.rank != t->rank || memcmp(a.shape, t->shape, sizeof(int64_t) * (size_t)t->rank) != 0
               || a.count * dtype_size(t->dtype) != t->nbytes) {
        format_tensor(t, shape, sizeof shape);
        char *got = why;
        size_t o = (size_t)snprintf(got, sizeof why, "[");
        for (int32_t k = 0; k < a.rank; k++) {
            o += (size_t)snprintf(got + o, sizeof why - o, k ? ",%" PRId64 : "%" PRId64, a.shape[k]);
        }
        snprintf(got + o, sizeof why - o, "]");
        rc = report(NPUC_E_INPUT, "npuc models have static shapes; recompile with the --input_shape you need",
                    "input '%s' has shape %s, the model was compiled for %s", t->name, got,
                    strchr(shape, '[') ? strchr(shape, '[') : shape);
    } else if ((*out = malloc(t->nbytes ? t->nbytes : 1)) == NULL) {
        rc = report(NPUC_E_ARG, NULL, "out of memory");
    } else if (npy_convert(&a, t->dtype, *out, why, sizeof why) != 0) {
        rc = report(NPUC_E_INPUT, "give the input in the model's dtype", "input '%s' %s", t->name, why);
    }
    free(data);
    return rc;
}

static int cmd_run(const char *path, const char *program_name, const input_arg *args, int n_args,
                   const char *output_dir, int threads) {
    npuc_model *m = NULL;
    npuc_session *s = NULL;
    int rc = load_model(path, 1, &m), n_in = 0, n_out = 0;
    void **in = NULL, **out = NULL;
    uint64_t *in_bytes = NULL, *out_bytes = NULL;
    npuc_tensor_info *out_info = NULL;
    char names[1024], line[2048];
    if (rc != 0) {
        return rc;
    }
    int32_t program = 0;
    if (program_name != NULL && npuc_model_find_program(m, program_name, &program) != NPUC_OK) {
        program_names(m, names, sizeof names);
        snprintf(line, sizeof line, "the model's programs are %s", names);
        rc = report(NPUC_E_NO_PROGRAM, line, "the model has no program '%s'", program_name);
        goto done;
    }
    int32_t ni = 0, no = 0;
    npuc_model_input_count(m, program, &ni);
    npuc_model_output_count(m, program, &no);
    n_in = ni;
    n_out = no;
    in = calloc((size_t)n_in + 1, sizeof *in);
    in_bytes = calloc((size_t)n_in + 1, sizeof *in_bytes);
    out = calloc((size_t)n_out + 1, sizeof *out);
    out_bytes = calloc((size_t)n_out + 1, sizeof *out_bytes);
    out_info = calloc((size_t)n_out + 1, sizeof *out_info);
    if (!in || !in_bytes || !out || !out_bytes || !out_info) {
        rc = report(NPUC_E_ARG, NULL, "out of memory");
        goto done;
    }

    /* Every name given must be an input, every input given: said at once, as npuc does. */
    char missing[1024] = "", unknown[1024] = "";
    size_t om = 0, ou = 0;
    for (int32_t i = 0; i < n_in; i++) {
        npuc_tensor_info t;
        npuc_model_input(m, program, i, &t);
        int found = 0;
        for (int a = 0; a < n_args; a++) {
            found |= strcmp(args[a].name, t.name) == 0;
        }
        if (!found && om < sizeof missing) {
            om += (size_t)snprintf(missing + om, sizeof missing - om, "%s'%s'", om ? ", " : "", t.name);
        }
    }
    for (int a = 0; a < n_args; a++) {
        int found = 0;
        for (int32_t i = 0; i < n_in; i++) {
            npuc_tensor_info t;
            npuc_model_input(m, program, i, &t);
            found |= strcmp(args[a].name, t.name) == 0;
        }
        if (!found && ou < sizeof unknown) {
            ou += (size_t)snprintf(unknown + ou, sizeof unknown - ou, "%s'%s'", ou ? ", " : "", args[a].name);
        }
    }
    if (om || ou) {
        size_t o = (size_t)snprintf(line, sizeof line, "the model's inputs are ");
        for (int32_t i = 0; i < n_in && o < sizeof line; i++) {
            npuc_tensor_info t;
            npuc_model_input(m, program, i, &t);
            format_tensor(&t, names, sizeof names);
            o += (size_t)snprintf(line + o, sizeof line - o, "%s%s", i ? ", " : "", names);
        }
        rc = report(NPUC_E_INPUTS, line, "inputs do not match the model: missing [%s], unknown [%s]", missing,
                    unknown);
        goto done;
    }

    for (int32_t i = 0; i < n_in; i++) {
        npuc_tensor_info t;
        npuc_model_input(m, program, i, &t);
        const char *file = NULL;
        for (int a = 0; a < n_args; a++) {
            file = strcmp(args[a].name, t.name) == 0 ? args[a].path : file;
        }
        in_bytes[i] = t.nbytes;
        if ((rc = read_input(&t, file, &in[i])) != 0) {
            goto done;
        }
    }
    for (int32_t i = 0; i < n_out; i++) {
        npuc_model_output(m, program, i, &out_info[i]);
        out_bytes[i] = out_info[i].nbytes;
        out[i] = malloc(out_bytes[i] ? out_bytes[i] : 1);
        if (out[i] == NULL) {
            rc = report(NPUC_E_ARG, NULL, "out of memory");
            goto done;
        }
    }

    if ((rc = make_session(m, threads, &s)) != 0) {
        goto done;
    }
    npuc_error err = {0};
    int st = npuc_session_run(s, program, (const void *const *)in, in_bytes, n_in, out, out_bytes, n_out, &err);
    if (st != NPUC_OK) {
        rc = report_lib(st, &err, "running the program");
        goto done;
    }
    if (output_dir != NULL && make_dirs(output_dir) != 0) {
        rc = report(E_WRITE, "give a directory you can write to", "cannot create the output directory '%s': %s",
                    output_dir, strerror(errno));
        goto done;
    }
    for (int32_t i = 0; i < n_out; i++) {
        format_tensor(&out_info[i], line, sizeof line);
        if (output_dir == NULL) {
            printf("%s\n", line);
            continue;
        }
        /* The file name npuc run gives: the output's name with anything unusual as '_'. */
        char fname[512];
        size_t k = 0, len = strlen(output_dir);
        const char *sep = len && output_dir[len - 1] == '/' ? "" : "/";
        for (const char *c = out_info[i].name; *c && k + 5 < sizeof fname; c++) {
            int ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9')
                     || *c == '.' || *c == '_' || *c == '-';
            fname[k++] = ok ? *c : '_';
        }
        memcpy(fname + k, ".npy", 5);
        char full[4096 + 512];
        snprintf(full, sizeof full, "%s%s%s", output_dir, sep, fname);
        if (npy_write(full, &out_info[i], out[i]) != 0) {
            rc = report(E_WRITE, "give a directory you can write to", "cannot write output '%s' to '%s': %s",
                        out_info[i].name, full, strerror(errno));
            goto done;
        }
        printf("%s -> %s\n", line, full);
    }
    rc = 0;
done:
    for (int i = 0; in && i < n_in; i++) {
        free(in[i]);
    }
    for (int i = 0; out && i < n_out; i++) {
        free(out[i]);
    }
    free(in);
    free(in_bytes);
    free(out);
    free(out_bytes);
    free(out_info);
    npuc_session_free(s);
    npuc_model_free(m);
    return rc;
}

/* ---- generate ------------------------------------------------------------------------------ */

typedef struct token_list {
    int64_t *ids;
    int32_t n, cap;
} token_list;

typedef struct gen_state {
    int stream;         /* one prompt: print each token as it comes */
    int write_failed;
    token_list *seqs;
    int64_t total;
    double t_first;
} gen_state;

static int on_token(void *user, int32_t sequence, int64_t token) {
    gen_state *g = user;
    if (g->total++ == 0) {
        g->t_first = now_s();
    }
    if (g->stream) {
        /* Flushed per token: a reader of the pipe sees each one as it is decoded. */
        if (printf(g->seqs[0].n++ ? " %" PRId64 : "%" PRId64, token) < 0 || fflush(stdout) != 0) {
            g->write_failed = 1;
            return 1;
        }
        return 0;
    }
    token_list *t = &g->seqs[sequence];
    if (t->n == t->cap) {
        int32_t cap = t->cap ? t->cap * 2 : 64;
        int64_t *ids = realloc(t->ids, sizeof *ids * (size_t)cap);
        if (ids == NULL) {
            g->write_failed = 1;
            return 1;
        }
        t->ids = ids;
        t->cap = cap;
    }
    t->ids[t->n++] = token;
    return 0;
}

/* Token ids as npuc takes them: ASCII decimals separated by a comma (spaces around it allowed)
 * or by spaces. 0, or an exit code after the error is printed. */
static int parse_ids(const char *text, int64_t **out, int32_t *n_out) {
    const char *p = text;
    int32_t n = 0, cap = 16;
    int64_t *ids = malloc(sizeof *ids * (size_t)cap);
    const char *bad = NULL;
    if (ids == NULL) {
        return report(NPUC_E_ARG, NULL, "out of memory");
    }
    while (*p == ' ' || *p == '\t') {
        p++;
    }
    for (;;) {
        if (*p < '0' || *p > '9') {
            bad = p;
            break;
        }
        int64_t v = 0;
        while (*p >= '0' && *p <= '9') {
            if (v > (INT64_MAX - (*p - '0')) / 10) {
                free(ids);
                return report(NPUC_E_PROMPT, "token ids run from 0 to the vocabulary size - 1",
                              "--prompt-ids '%s': an id is too large", text);
            }
            v = v * 10 + (*p++ - '0');
        }
        if (n == cap) {
            int64_t *more = realloc(ids, sizeof *ids * (size_t)(cap *= 2));
            if (more == NULL) {
                free(ids);
                return report(NPUC_E_ARG, NULL, "out of memory");
            }
            ids = more;
        }
        ids[n++] = v;
        const char *q = p;
        while (*p == ' ' || *p == '\t') {
            p++;
        }
        if (*p == '\0') {
            break;
        }
        if (*p == ',') {
            p++;
            while (*p == ' ' || *p == '\t') {
                p++;
            }
        } else if (p == q) { /* no separator after the id */
            while (p > text && p[-1] >= '0' && p[-1] <= '9') {
                p--;
            }
            bad = p;
            break;
        }
    }
    if (bad != NULL) {
        /* Name the item as npuc does: the text up to the next separator. */
        size_t len = strcspn(bad, ", \t");
        free(ids);
        if (len == 0) {
            return report(NPUC_E_PROMPT, "write non-negative decimal ids separated by commas or spaces, "
                          "e.g. --prompt-ids 1,2,3", "--prompt-ids '%s': an empty item", text);
        }
        return report(NPUC_E_PROMPT, "write non-negative decimal ids separated by commas or spaces, e.g. "
                      "--prompt-ids 1,2,3", "--prompt-ids '%s': '%.*s' is not an ASCII decimal token id", text,
                      (int)len, bad);
    }
    *out = ids;
    *n_out = n;
    return 0;
}

/* The drafted tokens a step for --speculative: the verify program's K where the model has one
 * (`tokens` -1: speculate where it can, as npuc generate does), else 0. */
static int32_t verify_tokens(const npuc_model *m) {
    int32_t count = 0;
    const char *name = NULL;
    npuc_tensor_info info;
    npuc_model_program_count(m, &count);
    for (int32_t p = 0; p < count; p++) {
        if (npuc_model_program_name(m, p, &name) == NPUC_OK && strcmp(name, "verify") == 0 &&
            npuc_model_input(m, p, 0, &info) == NPUC_OK && info.rank == 2 && info.shape[1] > 1) {
            return (int32_t)(info.shape[1] - 1);
        }
    }
    return 0;
}

static int cmd_generate(const char *path, const char *const *prompts, int n_prompts, int32_t max_new,
                        int ignore_eos, int threads, int timing, int verify, const npuc_sampling *sampling,
                        const npuc_speculation *speculation, double t_start) {
    npuc_model *m = NULL;
    npuc_session *s = NULL;
    npuc_sequence *seqs = calloc((size_t)n_prompts, sizeof *seqs);
    token_list *lists = calloc((size_t)n_prompts, sizeof *lists);
    npuc_sampling *each = sampling ? calloc((size_t)n_prompts, sizeof *each) : NULL;
    int rc = 0;
    if (seqs == NULL || lists == NULL || (sampling && each == NULL)) {
        rc = report(NPUC_E_ARG, NULL, "out of memory");
        goto done;
    }
    for (int i = 0; i < n_prompts; i++) { /* usage errors before the load, as npuc */
        int64_t *ids = NULL;
        int32_t n = 0;
        if ((rc = parse_ids(prompts[i], &ids, &n)) != 0) {
            goto done;
        }
        seqs[i].prompt = ids;
        seqs[i].prompt_len = n;
        seqs[i].max_new_tokens = max_new;
        seqs[i].ignore_eos = ignore_eos;
        if (sampling) { /* prompt i draws with seed S + i, as npuc generate */
            each[i] = *sampling;
            each[i].seed = sampling->seed + (uint64_t)i;
            seqs[i].sampling = &each[i];
        }
    }
    double t_load = now_s();
    if ((rc = load_model(path, verify, &m)) != 0 || (rc = make_session(m, threads, &s)) != 0) {
        goto done;
    }
    gen_state g = {.stream = n_prompts == 1, .seqs = lists};
    npuc_error err = {0};
    double t_gen = now_s();
    npuc_speculation spec = *speculation;
    if (spec.tokens < 0) {
        spec.tokens = verify_tokens(m);
    }
    npuc_speculation_stats stats = {0};
    int st = npuc_generate_speculative(s, seqs, n_prompts, &spec, &stats, on_token, &g, &err);
    double t_end = now_s();
    if (g.stream && (st == NPUC_OK || lists[0].n > 0)) {
        printf("\n"); /* ends the line of tokens (an empty one when none came, as npuc prints) */
    }
    if (st != NPUC_OK) {
        fflush(stdout);
        rc = report_lib(st, &err, "generating");
        goto done;
    }
    if (g.write_failed) {
        rc = report(E_WRITE, NULL, "cannot write the tokens to stdout (or out of memory)");
        goto done;
    }
    for (int i = 0; !g.stream && i < n_prompts; i++) { /* one JSON line each, as npuc prints them */
        printf("{\"index\": %d, \"token_ids\": [", i);
        for (int32_t k = 0; k < lists[i].n; k++) {
            printf(k ? ", %" PRId64 : "%" PRId64, lists[i].ids[k]);
        }
        printf("]}\n");
    }
    if (fflush(stdout) != 0) {
        rc = report(E_WRITE, NULL, "cannot write the tokens to stdout");
        goto done;
    }
    if (timing) {
        /* Each sequence's first token comes from its prefill; the rest are decode steps. */
        int64_t decoded = g.total;
        for (int i = 0; i < n_prompts; i++) {
            decoded -= lists[i].n > 0;
        }
        double span = t_end - g.t_first;
        fprintf(stderr, "npucrt: load %.1f ms, first token %.1f ms after start, prefill %.1f ms, "
                "decode %" PRId64 " tokens in %.1f ms (%.1f tokens/s)\n",
                (t_gen - t_load) * 1e3, g.total ? (g.t_first - t_start) * 1e3 : 0.0,
                g.total ? (g.t_first - t_gen) * 1e3 : 0.0, decoded, g.total ? span * 1e3 : 0.0,
                decoded > 0 && span > 0 ? (double)decoded / span : 0.0);
        if (spec.tokens > 0) {
            fprintf(stderr, "npucrt: speculation: %" PRId64 " steps, %" PRId64 " verify, %" PRId64 " drafted, %" PRId64
                    " accepted (%.2f), %.2f tokens a step\n", stats.steps, stats.verify_steps, stats.drafted,
                    stats.accepted, stats.drafted ? (double)stats.accepted / (double)stats.drafted : 0.0,
                    stats.steps ? (double)stats.tokens / (double)stats.steps : 0.0);
        }
    }
    rc = 0;
done:
    for (int i = 0; seqs && i < n_prompts; i++) {
        free((void *)seqs[i].prompt);
        if (lists) {
            free(lists[i].ids);
        }
    }
    free(seqs);
    free(lists);
    free(each);
    npuc_session_free(s);
    npuc_model_free(m);
    return rc;
}

/* ---- the command line ----------------------------------------------------------------------- */

static const char USAGE[] =
    "usage: npucrt [--version] COMMAND ...\n"
    "\n"
    "  npucrt info MODEL.om\n"
    "      programs, their inputs and outputs, memory, generation settings\n"
    "  npucrt run MODEL.om [--program NAME] --input NAME=FILE.npy ... [--output-dir DIR] [--threads T]\n"
    "      run one program on .npy inputs; writes DIR/<output>.npy\n"
    "  npucrt generate MODEL.om --prompt-ids 1,2,3 [--prompt-ids ...] [--max-new-tokens N]\n"
    "                  [--ignore-eos] [--threads T] [--timing] [--no-verify]\n"
    "                  [--temperature F] [--top-p F] [--top-k N] [--min-p F] [--seed N]\n"
    "                  [--repetition-penalty F] [--presence-penalty F] [--frequency-penalty F]\n"
    "                  [--speculative ngram|off] [--ngram-min N] [--ngram-max N]\n"
    "      greedy decoding, or sampled (--temperature above 0; prompt i draws with seed N + i);\n"
    "      a model compiled with --speculative_tokens K drafts greedy tokens from the sequence's\n"
    "      own (n-grams of 2 to 4 tokens) and checks them K at a time, unless --speculative off;\n"
    "      one prompt: its new token ids on one line, as they come;\n"
    "      several: one JSON line each, {\"index\", \"token_ids\"}, in order\n";

/* Whether `a` is `flag` or `flag=...`, spelled with - or _ after its dashes (npuc takes both):
 * the length of the match (where '=' or the end is), or 0. */
static size_t flag_match(const char *a, const char *flag) {
    size_t n = strlen(flag);
    for (size_t k = 0; k < n; k++) {
        char c = k >= 2 && a[k] == '_' ? '-' : a[k];
        if (c != flag[k]) {
            return 0;
        }
    }
    return a[n] == '\0' || a[n] == '=' ? n : 0;
}

/* `--flag VALUE` or `--flag=VALUE`: 1 when argv[*i] is the flag (value set, *i moved past it),
 * 0 when it is not, -1 when it lacks its value. */
static int flag_value(int argc, char **argv, int *i, const char *flag, const char **value) {
    size_t n = flag_match(argv[*i], flag);
    if (n == 0) {
        return 0;
    }
    if (argv[*i][n] == '=') {
        *value = argv[*i] + n + 1;
        return 1;
    }
    if (*i + 1 >= argc) {
        return -1;
    }
    *value = argv[++*i];
    return 1;
}

/* One of the number flags: 1 with its field set, -1 where its value is missing or not a
 * finite number (*value: the offending text), 0 when `argv[*i]` is none of them. */
static int float_flag(int argc, char **argv, int *i, const char *const *flags, float *const *fields, int n,
                      const char **value) {
    for (int k = 0; k < n; k++) {
        int r = flag_value(argc, argv, i, flags[k], value);
        if (r > 0 && parse_float(*value, fields[k]) != 0) {
            return -1;
        }
        if (r != 0) {
            return r;
        }
    }
    return 0;
}

static int is_flag(const char *a, const char *flag) {
    size_t n = flag_match(a, flag);
    return n > 0 && a[n] == '\0';
}

int main(int argc, char **argv) {
    double t_start = now_s();
    if (argc < 2) {
        fputs(USAGE, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("npucrt %s (ABI %d)\n", NPUCRT_VERSION_STRING, npuc_abi_version());
        return 0;
    }
    if (strcmp(cmd, "info") != 0 && strcmp(cmd, "run") != 0 && strcmp(cmd, "generate") != 0) {
        return usage_error(NULL, "no such command '%s'", cmd);
    }

    const char *model = NULL, *program = NULL, *output_dir = NULL, *value = NULL;
    input_arg *inputs = calloc((size_t)argc, sizeof *inputs);
    const char **prompts = calloc((size_t)argc, sizeof *prompts);
    int n_inputs = 0, n_prompts = 0, ignore_eos = 0, timing = 0, verify = 1, sampled = 0, rc = 0, r;
    long long threads = 0, max_new = 32, number = 0;
    npuc_sampling sampling;
    npuc_sampling_default(&sampling);
    npuc_speculation speculation = {-1, 2, 4, 1.0f}; /* -1: where the model has a verify program */
    long long ngram = 0;
    static const char *const float_flags[] = {"--temperature", "--top-p", "--min-p", "--repetition-penalty",
                                              "--presence-penalty", "--frequency-penalty"};
    float *const float_fields[] = {&sampling.temperature, &sampling.top_p, &sampling.min_p,
                                   &sampling.repetition_penalty, &sampling.presence_penalty,
                                   &sampling.frequency_penalty};
    int is_run = strcmp(cmd, "run") == 0, is_gen = strcmp(cmd, "generate") == 0;
    if (inputs == NULL || prompts == NULL) {
        rc = report(NPUC_E_ARG, NULL, "out of memory");
        goto out;
    }
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(USAGE, stdout);
            goto out;
        }
        if ((is_run || is_gen) && (r = flag_value(argc, argv, &i, "--threads", &value)) != 0) {
            if (r < 0 || parse_int(value, 0, 4096, &threads) != 0) {
                rc = r < 0 ? usage_error(cmd, "%s needs a value", "--threads")
                           : usage_error(cmd, "--threads takes a number from 0 (every CPU) to 4096, not '%s'", value);
                goto out;
            }
        } else if (is_run && (r = flag_value(argc, argv, &i, "--program", &value)) != 0) {
            if (r < 0) {
                rc = usage_error(cmd, "%s needs a value", "--program");
                goto out;
            }
            program = value;
        } else if (is_run && (r = flag_value(argc, argv, &i, "--output-dir", &value)) != 0) {
            if (r < 0 || value[0] == '\0') {
                rc = usage_error(cmd, "%s needs a directory", "--output-dir");
                goto out;
            }
            output_dir = value;
        } else if (is_run && (r = flag_value(argc, argv, &i, "--input", &value)) != 0) {
            const char *eq = r > 0 ? strchr(value, '=') : NULL;
            if (eq == NULL || eq == value || eq[1] == '\0') {
                rc = report(E_BAD_INPUT, "write --input NAME=FILE.npy", "bad --input '%s'", r > 0 ? value : "");
                goto out;
            }
            char *name = strndup(value, (size_t)(eq - value));
            if (name == NULL) {
                rc = report(NPUC_E_ARG, NULL, "out of memory");
                goto out;
            }
            for (int k = 0; k < n_inputs; k++) {
                if (strcmp(inputs[k].name, name) == 0) {
                    rc = report(E_BAD_INPUT, "give each input once", "--input '%s' is given twice", name);
                    free(name);
                    goto out;
                }
            }
            inputs[n_inputs].name = name;
            inputs[n_inputs++].path = eq + 1;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--prompt-ids", &value)) != 0) {
            if (r < 0) {
                rc = usage_error(cmd, "%s needs a value", "--prompt-ids");
                goto out;
            }
            prompts[n_prompts++] = value;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--max-new-tokens", &value)) != 0) {
            if (r < 0 || parse_int(value, 1, LLONG_MAX, &max_new) != 0) {
                rc = r < 0 ? usage_error(cmd, "%s needs a value", "--max-new-tokens")
                           : usage_error(cmd, "--max-new-tokens takes an integer of at least 1, not '%s'", value);
                goto out;
            }
        } else if (is_gen && (r = float_flag(argc, argv, &i, float_flags, float_fields, 6, &value)) != 0) {
            if (r < 0) {
                rc = usage_error(cmd, "%s needs a finite number", a);
                goto out;
            }
            sampled = 1;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--top-k", &value)) != 0) {
            if (r < 0 || parse_int(value, 0, INT32_MAX, &number) != 0) {
                rc = usage_error(cmd, "--top-k takes an integer of at least 0, not '%s'", r < 0 ? "" : value);
                goto out;
            }
            sampling.top_k = (int32_t)number, sampled = 1;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--seed", &value)) != 0) {
            if (r < 0 || parse_int(value, 0, LLONG_MAX, &number) != 0) {
                rc = usage_error(cmd, "--seed takes an integer of at least 0, not '%s'", r < 0 ? "" : value);
                goto out;
            }
            sampling.seed = (uint64_t)number, sampled = 1;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--speculative", &value)) != 0) {
            if (r < 0 || (strcmp(value, "ngram") != 0 && strcmp(value, "off") != 0)) {
                rc = usage_error(cmd, "--speculative takes ngram or off, not '%s'", r < 0 ? "" : value);
                goto out;
            }
            speculation.tokens = strcmp(value, "off") == 0 ? 0 : -1;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--ngram-min", &value)) != 0) {
            if (r < 0 || parse_int(value, 1, 32, &ngram) != 0) {
                rc = usage_error(cmd, "--ngram-min takes an integer from 1 to 32, not '%s'", r < 0 ? "" : value);
                goto out;
            }
            speculation.ngram_min = (int32_t)ngram;
        } else if (is_gen && (r = flag_value(argc, argv, &i, "--ngram-max", &value)) != 0) {
            if (r < 0 || parse_int(value, 1, 32, &ngram) != 0) {
                rc = usage_error(cmd, "--ngram-max takes an integer from 1 to 32, not '%s'", r < 0 ? "" : value);
                goto out;
            }
            speculation.ngram_max = (int32_t)ngram;
        } else if (is_gen && is_flag(a, "--ignore-eos")) {
            ignore_eos = 1;
        } else if (is_gen && is_flag(a, "--timing")) {
            timing = 1;
        } else if (is_gen && is_flag(a, "--no-verify")) {
            verify = 0; /* the weights' chunk checksums: the header sections' and every other check still run */
        } else if (a[0] == '-' && a[1] != '\0') {
            rc = usage_error(cmd, "no such option: %s", a);
            goto out;
        } else if (model == NULL) {
            model = a;
        } else {
            rc = usage_error(cmd, "got unexpected extra argument (%s)", a);
            goto out;
        }
    }
    if (model == NULL) {
        rc = usage_error(cmd, "missing argument '%s'", "MODEL.om");
        goto out;
    }
    if (strcmp(cmd, "info") == 0) {
        rc = cmd_info(model);
    } else if (is_run) {
        rc = cmd_run(model, program, inputs, n_inputs, output_dir, (int)threads);
    } else if (n_prompts == 0) {
        rc = report(NPUC_E_PROMPT, "npucrt generate model.om --prompt-ids 1,2,3 --max-new-tokens 32",
                    "no prompt: give --prompt-ids");
    } else {
        npuc_error err = {0};
        if (sampled && (r = npuc_sampling_check(&sampling, INT64_MAX, &err)) != 0) { /* before the load */
            rc = report_lib(r, &err, "checking the sampling flags");
            goto out;
        }
        if (speculation.ngram_min > speculation.ngram_max) {
            char both[64];
            snprintf(both, sizeof both, "%d above --ngram-max %d", (int)speculation.ngram_min,
                     (int)speculation.ngram_max);
            rc = usage_error(cmd, "--ngram-min %s", both);
            goto out;
        }
        /* More than INT32_MAX new tokens is "until the cache is full" all the same. */
        rc = cmd_generate(model, prompts, n_prompts, max_new > INT32_MAX ? INT32_MAX : (int32_t)max_new,
                          ignore_eos, (int)threads, timing, verify, sampled ? &sampling : NULL, &speculation,
                          t_start);
    }
out:
    for (int k = 0; inputs && k < n_inputs; k++) {
        free((void *)inputs[k].name);
    }
    free(inputs);
    free(prompts);
    return rc;
}
