/* libnpucrt: npuc's native runtime. Loads a `.om`, checks it, and executes its programs
 * on the CPU with nothing but libc, libm and pthreads.
 *
 * The whole contract is this header (docs/c-api.md walks through it):
 *
 *   npuc_model    a loaded, validated `.om`: read-only, its weights memory-mapped (or the
 *                 caller's buffer, borrowed). Safe to share between sessions and threads.
 *   npuc_session  what one executor owns: the activation arena, the state region (KV caches),
 *                 weights packed for this CPU, scratch. One thread at a time per session;
 *                 sessions of one model run concurrently.
 *
 * Every function that can fail returns an int status: 0 (NPUC_OK) or the number of the
 * `NPUC-Exxxx` code the Python side prints for the same problem (404 for NPUC-E0404), with
 * the same message in `npuc_error` where the caller passes one. Nothing is global: the
 * library keeps no state between calls beyond the objects the caller holds, and one thread
 * pool per session.
 */
#ifndef NPUCRT_H
#define NPUCRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NPUCRT_ABI_VERSION 2
#define NPUC_MAX_RANK 8

#define NPUC_OK 0
/* The most common codes (docs/errors.md lists them all). */
#define NPUC_E_NO_PROGRAM 111 /* no program of that name / none to generate with */
#define NPUC_E_INPUTS 107     /* inputs missing or unknown */
#define NPUC_E_INPUT 108      /* an input's shape, dtype or value (position, slot, token id) */
#define NPUC_E_PROMPT 125     /* a prompt generation cannot take */
#define NPUC_E_SAMPLING 160   /* a sampling parameter out of its range */
#define NPUC_E_OPEN 401       /* cannot open or read the file */
#define NPUC_E_MAGIC 402      /* not a .om */
#define NPUC_E_VERSION 403    /* format version or flags */
#define NPUC_E_BOUNDS 404     /* truncated; an offset or size outside the file or region */
#define NPUC_E_PARSE 405      /* a checksum, or a model definition that does not parse */
#define NPUC_E_UNKNOWN_OP 408 /* an op no npuc knows */
#define NPUC_E_PLAN 409       /* an invalid memory plan */
#define NPUC_E_INVALID 410    /* fails validation: operands, shapes, sizes, memory cap */
#define NPUC_E_META 411       /* metadata or tokenizer section malformed */
#define NPUC_E_KERNEL 412     /* a kernel refused the values the model computed */
#define NPUC_E_NO_KERNEL 413  /* an op (or operand combination) this library has no kernel for */
#define NPUC_E_ARG 414        /* a C API argument: NULL, a size that does not match, out of memory */

typedef enum npuc_dtype {
    NPUC_F64 = 0, NPUC_F32 = 1, NPUC_F16 = 2, NPUC_BF16 = 3, NPUC_I64 = 4,
    NPUC_I32 = 5, NPUC_I16 = 6, NPUC_I8 = 7, NPUC_U8 = 8, NPUC_BOOL = 9
} npuc_dtype;

typedef struct npuc_error {
    int code;           /* 0, or the NPUC-E code's number */
    char message[768];  /* one line, as the Python side words it */
    char hint[256];
} npuc_error;

typedef struct npuc_model npuc_model;
typedef struct npuc_session npuc_session;

typedef struct npuc_tensor_info {
    const char *name;   /* valid while the model lives */
    npuc_dtype dtype;
    int32_t rank;
    int64_t shape[NPUC_MAX_RANK];
    uint64_t nbytes;
} npuc_tensor_info;

typedef struct npuc_load_options {
    uint32_t struct_size;      /* sizeof(npuc_load_options): later fields may be added */
    int32_t verify_checksums;  /* 1 (default): also every weights chunk's XXH3-128 before any use
                                  (header sections' SHA-256s are always checked) */
    uint64_t max_memory;       /* arena + state cap in bytes; 0: NPUC_MAX_MEMORY, else physical memory */
} npuc_load_options;

typedef struct npuc_session_options {
    uint32_t struct_size;   /* sizeof(npuc_session_options) */
    int32_t threads;        /* worker threads incl. the caller; 0: the online CPUs */
    int32_t prepack;        /* 1 (default): pack prefill's matrix weights for the GEMM at creation */
} npuc_session_options;

/* What generation needs to know (npuc_model_generation_info). */
typedef struct npuc_generation_info {
    int32_t slots;          /* sequences the KV cache holds */
    int32_t max_seq_len;    /* positions a sequence may use */
    int32_t prefill_len;    /* tokens one prefill takes (a shorter prompt is padded) */
    int32_t decode_tokens;  /* tokens of each slot one decode step takes (--decode_tokens) */
    int64_t vocab;          /* token ids the embedding takes: 0..vocab-1 */
    int64_t logits_width;   /* entries of one row of logits */
    int32_t n_eos;
    const int64_t *eos;     /* end-of-sequence ids; valid while the model lives */
} npuc_generation_info;

/* Library */
int npuc_abi_version(void);
/* "NPUC-E0404" for 404 into buf (at least 11 bytes). */
int npuc_code_string(int code, char *buf, size_t size);

/* Loading: the file is mapped read-only; a buffer is borrowed and must outlive the model. */
void npuc_load_options_default(npuc_load_options *opts);
int npuc_model_load_file(const char *path, const npuc_load_options *opts, npuc_model **out, npuc_error *err);
int npuc_model_load_buffer(const void *data, size_t size, const npuc_load_options *opts, npuc_model **out,
                           npuc_error *err);
int npuc_model_free(npuc_model *model);

/* Queries (no error message: the status alone says what is wrong). */
int npuc_model_program_count(const npuc_model *m, int32_t *count);
int npuc_model_program_name(const npuc_model *m, int32_t program, const char **name);
int npuc_model_find_program(const npuc_model *m, const char *name, int32_t *program);
int npuc_model_input_count(const npuc_model *m, int32_t program, int32_t *count);
int npuc_model_output_count(const npuc_model *m, int32_t program, int32_t *count);
int npuc_model_input(const npuc_model *m, int32_t program, int32_t index, npuc_tensor_info *info);
int npuc_model_output(const npuc_model *m, int32_t program, int32_t index, npuc_tensor_info *info);
/* Arena bytes (the largest program's) and state bytes a session allocates. */
int npuc_model_memory(const npuc_model *m, uint64_t *arena_bytes, uint64_t *state_bytes, uint64_t *weights_bytes);
/* A metadata value by key (NPUC_E_META if absent); NUL-terminated, valid while the model lives. */
int npuc_model_metadata(const npuc_model *m, const char *key, const char **value);
/* A section's bytes (the tokenizer's, for instance); NPUC_E_PARSE if there is no such section. */
int npuc_model_section(const npuc_model *m, const char *name, const void **data, uint64_t *size);
/* NPUC_E_NO_PROGRAM (with a message) for a model without prefill and decode. */
int npuc_model_generation_info(const npuc_model *m, npuc_generation_info *info, npuc_error *err);

/* Sessions */
void npuc_session_options_default(npuc_session_options *opts);
int npuc_session_create(const npuc_model *m, const npuc_session_options *opts, npuc_session **out,
                        npuc_error *err);
int npuc_session_free(npuc_session *s);
/* Zero the whole state region (every slot's cache). */
int npuc_session_reset(npuc_session *s);
/* Bytes this session allocated beyond the arena and state (packed weights, scratch). */
int npuc_session_extra_bytes(const npuc_session *s, uint64_t *bytes);

/* Run a program on caller buffers: inputs[i] holds the program's input i (npuc_model_input),
 * exactly its nbytes; outputs[i] receives output i. Inputs that index memory (token ids,
 * positions, slots, last_token) are checked before anything runs. */
int npuc_session_run(npuc_session *s, int32_t program, const void *const *inputs, const uint64_t *input_bytes,
                     int32_t n_inputs, void *const *outputs, const uint64_t *output_bytes, int32_t n_outputs,
                     npuc_error *err);
/* The arena's copy of output `index` after the last run (valid until the next run). */
int npuc_session_output_view(npuc_session *s, int32_t program, int32_t index, const void **data);

/* Per-op profile of the last runs: the summed nanoseconds each op kind's kernels took and the
 * number of calls, since npuc_session_profile(s, 1, ...) turned it on. */
int npuc_session_profile(npuc_session *s, int32_t enable);
int npuc_session_profile_read(const npuc_session *s, int32_t program, uint64_t *kernel_ns, uint64_t *runs);
/* One step of the profile: its op kind and name, and its summed nanoseconds. Steps are the
 * program's ops less the views that run nothing; NPUC_E_ARG past the last. */
int npuc_session_profile_step(const npuc_session *s, int32_t program, int32_t step, const char **op,
                              const char **name, uint64_t *ns);

/* The decode loop. Logits rows may be NULL where the caller needs only the token. */

/* Prefill one slot from position 0 with a prompt of n tokens (n < max_seq_len; a prompt longer
 * than prefill_len is finished through decode steps of that slot alone). Writes the prompt's
 * last logits row (logits_width floats) and its greedy token. */
int npuc_prefill(npuc_session *s, int32_t slot, const int64_t *tokens, int32_t n, float *logits,
                 int64_t *next_token, npuc_error *err);
/* One decode step over every slot: tokens and positions hold decode_tokens entries per slot
 * (slots * decode_tokens), slot k's at [k * decode_tokens ...]. n_fed[k] (NULL: all) says how
 * many of them are real; the rest repeat the last (writing the same cache row again). A slot
 * with n_fed[k] == 0 is idle (fed token 0 at position 0 of its own rows, its result unused).
 * Writes, per slot, the logits row of its last fed token (slots * logits_width floats) and
 * its greedy token. */
int npuc_decode_step(npuc_session *s, const int64_t *tokens, const int64_t *positions, const int32_t *n_fed,
                     float *logits, int64_t *next_tokens, npuc_error *err);

/* Sampling (src/sample.c; docs/serving.md). Initialise with npuc_sampling_default: greedy,
 * every filter and penalty off. Applied in this order: logit_bias and banned ids, the
 * penalties, then temperature (0: greedy, the first largest logit), top_k, top_p, min_p, and a
 * draw. The draw's random number is a hash of (seed, the token's index in the output) alone,
 * so a seeded sequence gets the same tokens in any slot, beside any other sequences. */
typedef struct npuc_sampling {
    uint32_t struct_size;      /* sizeof(npuc_sampling) */
    float temperature;         /* >= 0; 0: greedy */
    float top_p;               /* (0, 1]; 1: off */
    int32_t top_k;             /* >= 0; 0: off */
    float min_p;               /* [0, 1]; 0: off */
    float presence_penalty;    /* [-2, 2]: subtracted once from each id the output holds */
    float frequency_penalty;   /* [-2, 2]: subtracted per occurrence in the output */
    float repetition_penalty;  /* > 0; 1: off. Over prompt and output: a logit > 0 divided, else multiplied */
    uint64_t seed;
    int32_t n_bias;            /* logit_bias: bias_values[i] (in [-100, 100]) added to bias_ids[i] */
    const int64_t *bias_ids;
    const float *bias_values;
    int32_t n_banned;          /* ids never chosen (e.g. the end ids before min_tokens) */
    const int64_t *banned;
    int64_t n_allowed_words;   /* a grammar's token mask: id i may be chosen iff bit i % 32 of */
    const uint32_t *allowed;   /* allowed[i / 32] is set (ids past the words: never); 0: no mask */
} npuc_sampling;

void npuc_sampling_default(npuc_sampling *p);
/* NPUC_E_SAMPLING naming the field out of its range; logit_bias ids must be < vocab. */
int npuc_sampling_check(const npuc_sampling *p, int64_t vocab, npuc_error *err);
/* The work space npuc_sample needs for a row of vocab logits. */
size_t npuc_sample_work_bytes(int64_t vocab);
/* The row after logit_bias, banned ids and the penalties (processed may be logits). */
int npuc_sampling_process(const float *logits, int64_t vocab, const npuc_sampling *sampling, const int64_t *prompt,
                          int32_t n_prompt, const int64_t *out, int32_t n_out, float *processed, npuc_error *err);
/* The draw's uniform number in [0, 1) for the output's token `index` under `seed`. */
double npuc_sample_uniform(uint64_t seed, int64_t index);
/* A token from one row of logits (not modified). prompt and out (the tokens generated so
 * far: n_out is also the draw's index) feed the penalties. sampling NULL: greedy. */
int npuc_sample(const float *logits, int64_t vocab, const npuc_sampling *sampling, const int64_t *prompt,
                int32_t n_prompt, const int64_t *out, int32_t n_out, void *work, size_t work_bytes, int64_t *token,
                npuc_error *err);

/* The distribution npuc_sample draws the token from (the same filters, in float): probs[vocab]
 * gets each id's probability, 0 for the ids the filters drop; a greedy choice is one id at 1
 * (a drafted token is kept with its probability here: apps/speculative.py). */
int npuc_sample_probs(const float *logits, int64_t vocab, const npuc_sampling *sampling, const int64_t *prompt,
                      int32_t n_prompt, const int64_t *out, int32_t n_out, void *work, size_t work_bytes, float *probs,
                      npuc_error *err);

/* Copy slot `from`'s state (its KV cache rows, every position) into slot `to`: one prefill
 * then serves several continuations of the same prompt (n > 1). The copy's next decode step
 * continues where `from` stands. */
int npuc_session_copy_slot(npuc_session *s, int32_t from, int32_t to, npuc_error *err);

/* Undo a verify step's rows past `row` in `slot`'s recurrent states: each state the model keeps
 * by verify row (`<state>.by_row`, a recurrent model compiled with --speculative_tokens K) gets
 * its copy from after row `row` (0..K) of the last verify step, K + 1 tokens of each slot (row
 * K, the last: nothing to undo, nothing copied). The
 * slot's next step then continues from that row's token; the KV caches need nothing (their rows
 * past it are never read, and written before any query does). NPUC_E_INPUT (108) for a model
 * without such states, or a slot or row out of range; nothing is copied then. */
int npuc_session_rollback(npuc_session *s, int32_t slot, int32_t row, npuc_error *err);

/* The prefix pool (--prefix_cache P): P entries beside the slots in the state region, each
 * the first positions of every cache of one sequence (a prompt prefix). entries gets P (0:
 * no pool), bytes the pool's share of npuc_model_memory's state bytes. Either may be NULL. */
int npuc_model_prefix_pool(const npuc_model *m, int32_t *entries, uint64_t *bytes, npuc_error *err);
/* Positions 0..n_positions-1 of every cache of `slot` into pool entry `entry` (n_positions from 1
 * to max_seq_len; a prefix of n tokens is n positions, whatever the cache's length). */
int npuc_session_prefix_save(npuc_session *s, int32_t slot, int32_t entry, int64_t n_positions, npuc_error *err);
/* The reverse: entry `entry`'s first n_positions into `slot`, whose next decode step then
 * continues at position n_positions (the slot's rows after them are left as they were, and
 * written before any query reads them). NPUC_E_INPUT (108) for a model without a pool, or an
 * entry, slot or n_positions out of range. */
int npuc_session_prefix_load(npuc_session *s, int32_t entry, int32_t slot, int64_t n_positions, npuc_error *err);

/* Called for each generated token: return 0 to go on, non-zero to end that sequence. */
typedef int (*npuc_token_callback)(void *user, int32_t sequence, int64_t token);

typedef struct npuc_sequence {
    const int64_t *prompt;
    int32_t prompt_len;
    int32_t max_new_tokens;
    int32_t ignore_eos;
    int64_t *out_tokens;    /* optional: receives up to max_new_tokens ids */
    int32_t n_out;          /* set: tokens generated */
    int32_t finish_reason;  /* set: NPUC_FINISH_* */
    const npuc_sampling *sampling; /* NULL: greedy. Penalties need out_tokens. */
} npuc_sequence;

#define NPUC_FINISH_STOP 1       /* an end-of-sequence id */
#define NPUC_FINISH_LENGTH 2     /* max_new_tokens */
#define NPUC_FINISH_CACHE_FULL 3 /* the sequence reached max_seq_len */
#define NPUC_FINISH_CALLBACK 4   /* the callback asked to stop */

/* Generation of many sequences over the model's slots (greedy, or each its own sampling): each is admitted into a free
 * slot (a prefill), all active slots decode together, and each gets the tokens it gets alone. */
int npuc_generate(npuc_session *s, npuc_sequence *seqs, int32_t n_seqs, npuc_token_callback cb, void *user,
                  npuc_error *err);

/* Speculative decoding in the generation loop (prompt lookup). On a model compiled with
 * --speculative_tokens K (a `verify` program of K + 1 tokens of each slot), each sequence
 * drafts up to `tokens` tokens a step from its own prompt and output: the tokens that followed the
 * latest earlier occurrence of its last n tokens (n from ngram_max down to ngram_min). One verify
 * step checks every slot's drafts: each row's token is the one plain decode chooses there (the
 * argmax, or the sequence's own seeded draw), and a slot keeps its drafts up to the first that
 * differs from it, and the token chosen there. The tokens are npuc_generate's, greedy or sampled,
 * one to K + 1 a step (a draft is kept with probability p(draft), as rejection sampling keeps a
 * one-token draft, and the output is plain decode's draws, whatever the speculation). A
 * model with recurrent state is rolled back to the last kept row (npuc_session_rollback). A verify
 * step runs only where each sequence's acceptance so far and both programs' measured step times
 * say it gives at least `min_gain` times plain decode's tokens a second (0: whenever a draft is
 * found); so text the drafts do not predict runs at plain decode's speed. */
typedef struct npuc_speculation {
    int32_t tokens;    /* drafted tokens a step, 1..K; 0: no speculation */
    int32_t ngram_min; /* 1..ngram_max (2 is the usual) */
    int32_t ngram_max; /* ..32 (4 is the usual) */
    float min_gain;    /* 1 is the usual; 0 verifies every draft found */
} npuc_speculation;

typedef struct npuc_speculation_stats {
    int64_t steps;        /* decode and verify steps run */
    int64_t verify_steps;
    int64_t drafted;      /* draft tokens checked */
    int64_t accepted;     /* of them, kept */
    int64_t tokens;       /* tokens chosen by the steps */
} npuc_speculation_stats;

/* npuc_generate with speculation: `spec` NULL (or tokens 0) is npuc_generate. NPUC_E_NO_PROGRAM for
 * a model without a verify program, NPUC_E_ARG for a value out of range. `stats`, if not NULL,
 * receives the counts. */
int npuc_generate_speculative(npuc_session *s, npuc_sequence *seqs, int32_t n_seqs, const npuc_speculation *spec,
                              npuc_speculation_stats *stats, npuc_token_callback cb, void *user, npuc_error *err);

#ifdef __cplusplus
}
#endif
#endif /* NPUCRT_H */
