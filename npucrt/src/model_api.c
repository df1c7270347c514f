/* The public model functions of npucrt.h: loading a `.om` (from a file, mapped read-only, or
 * from the caller's buffer), freeing it, and the queries on a loaded model.
 *
 * A load runs, in order: the container and model sections (om.c), the model-definition check
 * (validate.c), the executor's dry bind of every op (exec.c), and the rank check the Python
 * session makes last (a tensor-parallel rank file is for `torchrun`, never for this library).
 * Whatever fails, everything allocated so far is freed before the status is returned.
 */
#define _POSIX_C_SOURCE 200809L /* pread, O_CLOEXEC, strerror_r */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "exec.h"
#include "model.h"
#include "npucrt.h"

#define NPUC_E_RANK 150
#define HINT_OPEN "check the path and its permissions"

static int arg_error(npuc_error *err, const char *what) {
    return rt_fail(err, NPUC_E_ARG, NULL, "%s", what);
}

/* strerror_r in its POSIX form (the GNU one returns a pointer; _POSIX_C_SOURCE selects this). */
static const char *os_error(int e, char *buf, size_t size) {
    if (strerror_r(e, buf, size) != 0) snprintf(buf, size, "error %d", e);
    return buf;
}

void npuc_load_options_default(npuc_load_options *opts) {
    if (opts == NULL) return;
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    opts->verify_checksums = 1;
    opts->max_memory = 0;
}

/* The caller's options, or the defaults; a struct from a later header is read as far as we know it. */
static int read_options(const npuc_load_options *in, npuc_load_options *out, npuc_error *err) {
    npuc_load_options_default(out);
    if (in == NULL) return NPUC_OK;
    if (in->struct_size < sizeof *out)
        return rt_fail(err, NPUC_E_ARG, "fill it with npuc_load_options_default() first",
                       "npuc_load_options.struct_size is %u, less than the %zu this library reads",
                       (unsigned)in->struct_size, sizeof *out);
    out->verify_checksums = in->verify_checksums;
    out->max_memory = in->max_memory;
    return NPUC_OK;
}

static void model_release(npuc_model *m) {
    if (m == NULL) return;
    if (m->mapping != NULL) munmap(m->mapping, m->size);
    pool_free(&m->pool);
    free(m);
}

int npuc_model_free(npuc_model *model) {
    model_release(model);
    return NPUC_OK;
}

/* runtime/parallel.check_rank, for a process of one rank (metadata checked by validate.c). */
static int check_rank(const npuc_model *m, npuc_error *err) {
    const char *w = NULL, *r = NULL;
    for (int32_t i = 0; i < m->n_meta; i++) {
        if (strcmp(m->meta[i].key, "parallel.world") == 0) w = m->meta[i].value;
        if (strcmp(m->meta[i].key, "parallel.rank") == 0) r = m->meta[i].value;
    }
    long long world = w != NULL && *w ? strtoll(w, NULL, 10) : 1, rank = r != NULL && *r ? strtoll(r, NULL, 10) : 0;
    if (world != 1) {
        char hint[160];
        snprintf(hint, sizeof hint, "load the manifest (<output>.om) with `torchrun --nproc-per-node %lld -m npuc ...`",
                 world);
        return rt_fail(err, NPUC_E_RANK, hint, "%s is rank %lld of %lld and this run has 1 rank", m->path, rank, world);
    }
    if (rank != 0)
        return rt_fail(err, NPUC_E_RANK, "load the manifest (<output>.om): each rank then opens its own file",
                       "%s is the file of rank %lld, loaded on rank 0", m->path, rank);
    return NPUC_OK;
}

/* Everything after the bytes are in place; frees the model on failure. */
static int load_model(npuc_model *m, const npuc_load_options *opts, npuc_model **out, npuc_error *err) {
    int rc = npuc_om_parse(m, opts->verify_checksums != 0, err);
    if (!rc) rc = npuc_validate_model(m, opts->max_memory ? opts->max_memory : npuc_memory_cap(), err);
    if (!rc) rc = npuc_exec_check(m, err);
    if (!rc) rc = check_rank(m, err);
    if (rc) {
        model_release(m);
        return rc;
    }
    if (err != NULL) {
        err->code = 0;
        err->message[0] = err->hint[0] = '\0';
    }
    *out = m;
    return NPUC_OK;
}

static npuc_model *model_new(const char *path) {
    npuc_model *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    /* Messages name the path; one longer than the field is cut (at a byte, as it fits). */
    snprintf(m->path, sizeof m->path, "%s", path);
    return m;
}

int npuc_model_load_file(const char *path, const npuc_load_options *opts, npuc_model **out, npuc_error *err) {
    if (out == NULL) return arg_error(err, "npuc_model_load_file: `out` is NULL");
    *out = NULL;
    if (path == NULL) return arg_error(err, "npuc_model_load_file: `path` is NULL");
    npuc_load_options o;
    int rc = read_options(opts, &o, err);
    if (rc) return rc;
    npuc_model *m = model_new(path);
    if (m == NULL) return arg_error(err, "out of memory");
    char why[256];
    /* O_NONBLOCK: a FIFO fails the regular-file check below instead of blocking the open. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        rc = rt_fail(err, NPUC_E_OPEN, HINT_OPEN, "cannot open '%s': %s", m->path, os_error(errno, why, sizeof why));
        model_release(m);
        return rc;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = rt_fail(err, NPUC_E_OPEN, HINT_OPEN, "cannot open '%s': %s", m->path, os_error(errno, why, sizeof why));
    } else if (!S_ISREG(st.st_mode)) {
        rc = rt_fail(err, NPUC_E_OPEN, HINT_OPEN, "cannot open '%s': not a regular file", m->path);
    } else if (st.st_size < 64) {
        /* Too short to map usefully: what is there says whether it is a truncated .om (E0404) or
         * not one at all (E0402); om.c words both. */
        uint8_t head[64];
        ssize_t got = pread(fd, head, sizeof head, 0);
        if (got < 0) {
            rc = rt_fail(err, NPUC_E_OPEN, HINT_OPEN, "cannot open '%s': %s", m->path,
                         os_error(errno, why, sizeof why));
        } else {
            m->data = head;
            m->size = (size_t)got;
            rc = npuc_om_parse(m, 0, err);
            if (!rc) rc = rt_fail(err, NPUC_E_BOUNDS, NULL, "file is truncated or corrupt: it has %zd bytes", got);
            m->data = NULL;
            m->size = 0;
        }
    } else if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        rc = rt_fail(err, NPUC_E_OPEN, HINT_OPEN, "cannot open '%s': [Errno %d] %s", m->path, EFBIG,
                     os_error(EFBIG, why, sizeof why));
    } else {
        size_t size = (size_t)st.st_size;
        void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            rc = rt_fail(err, NPUC_E_OPEN, HINT_OPEN, "cannot open '%s': [Errno %d] %s", m->path, e,
                         os_error(e, why, sizeof why));
        } else {
            m->mapping = map;
            m->data = map;
            m->size = size;
        }
    }
    close(fd); /* the mapping keeps its own reference to the file */
    if (rc) {
        model_release(m);
        return rc;
    }
    return load_model(m, &o, out, err);
}

int npuc_model_load_buffer(const void *data, size_t size, const npuc_load_options *opts, npuc_model **out,
                           npuc_error *err) {
    if (out == NULL) return arg_error(err, "npuc_model_load_buffer: `out` is NULL");
    *out = NULL;
    if (data == NULL && size != 0) return arg_error(err, "npuc_model_load_buffer: `data` is NULL");
    npuc_load_options o;
    int rc = read_options(opts, &o, err);
    if (rc) return rc;
    npuc_model *m = model_new("<buffer>");
    if (m == NULL) return arg_error(err, "out of memory");
    m->data = data;
    m->size = size;
    return load_model(m, &o, out, err);
}

/* ---- queries ------------------------------------------------------------------------------- */

static const rt_program *program_at(const npuc_model *m, int32_t program) {
    return m != NULL && program >= 0 && program < m->n_programs ? &m->programs[program] : NULL;
}

int npuc_model_program_count(const npuc_model *m, int32_t *count) {
    if (m == NULL || count == NULL) return NPUC_E_ARG;
    *count = m->n_programs;
    return NPUC_OK;
}

int npuc_model_program_name(const npuc_model *m, int32_t program, const char **name) {
    if (m == NULL || name == NULL) return NPUC_E_ARG;
    const rt_program *g = program_at(m, program);
    if (g == NULL) return NPUC_E_NO_PROGRAM;
    *name = g->name;
    return NPUC_OK;
}

int npuc_model_find_program(const npuc_model *m, const char *name, int32_t *program) {
    if (m == NULL || name == NULL || program == NULL) return NPUC_E_ARG;
    for (int32_t i = 0; i < m->n_programs; i++) {
        if (strcmp(m->programs[i].name, name) == 0) {
            *program = i;
            return NPUC_OK;
        }
    }
    return NPUC_E_NO_PROGRAM;
}

int npuc_model_input_count(const npuc_model *m, int32_t program, int32_t *count) {
    if (m == NULL || count == NULL) return NPUC_E_ARG;
    const rt_program *g = program_at(m, program);
    if (g == NULL) return NPUC_E_NO_PROGRAM;
    *count = g->n_inputs;
    return NPUC_OK;
}

int npuc_model_output_count(const npuc_model *m, int32_t program, int32_t *count) {
    if (m == NULL || count == NULL) return NPUC_E_ARG;
    const rt_program *g = program_at(m, program);
    if (g == NULL) return NPUC_E_NO_PROGRAM;
    *count = g->n_outputs;
    return NPUC_OK;
}

static void fill_info(const rt_tensor *t, npuc_tensor_info *info) {
    memset(info, 0, sizeof *info);
    info->name = t->name;
    info->dtype = (npuc_dtype)t->dtype;
    info->rank = t->rank;
    for (int32_t i = 0; i < t->rank && i < NPUC_MAX_RANK; i++) info->shape[i] = t->shape[i];
    info->nbytes = t->nbytes;
}

static int tensor_info(const npuc_model *m, int32_t program, int32_t index, npuc_tensor_info *info, int out) {
    if (m == NULL || info == NULL) return NPUC_E_ARG;
    const rt_program *g = program_at(m, program);
    if (g == NULL) return NPUC_E_NO_PROGRAM;
    int32_t n = out ? g->n_outputs : g->n_inputs;
    if (index < 0 || index >= n) return NPUC_E_ARG;
    fill_info(&m->tensors[(out ? g->outputs : g->inputs)[index]], info);
    return NPUC_OK;
}

int npuc_model_input(const npuc_model *m, int32_t program, int32_t index, npuc_tensor_info *info) {
    return tensor_info(m, program, index, info, 0);
}

int npuc_model_output(const npuc_model *m, int32_t program, int32_t index, npuc_tensor_info *info) {
    return tensor_info(m, program, index, info, 1);
}

int npuc_model_memory(const npuc_model *m, uint64_t *arena_bytes, uint64_t *state_bytes, uint64_t *weights_bytes) {
    if (m == NULL) return NPUC_E_ARG;
    if (arena_bytes != NULL) *arena_bytes = m->arena_bytes;
    if (state_bytes != NULL) *state_bytes = m->state_bytes;
    if (weights_bytes != NULL) *weights_bytes = m->weights_len;
    return NPUC_OK;
}

int npuc_model_metadata(const npuc_model *m, const char *key, const char **value) {
    if (m == NULL || key == NULL || value == NULL) return NPUC_E_ARG;
    /* The last entry of a key wins, as in the Python side's {key: value} dict. */
    for (int32_t i = m->n_meta; i-- > 0;) {
        if (strcmp(m->meta[i].key, key) == 0) {
            *value = m->meta[i].value;
            return NPUC_OK;
        }
    }
    return NPUC_E_META;
}

int npuc_model_section(const npuc_model *m, const char *name, const void **data, uint64_t *size) {
    if (m == NULL || name == NULL || data == NULL || size == NULL) return NPUC_E_ARG;
    const rt_section *s = npuc_om_section(m, name);
    if (s == NULL) return NPUC_E_PARSE;
    *data = m->data + s->offset;
    *size = s->size;
    return NPUC_OK;
}
