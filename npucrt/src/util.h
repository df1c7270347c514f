/* Helpers the loader's files (om.c, validate.c, model_api.c) share, implemented in util.c:
 * Python's repr() of strings and bytes, so that messages read exactly as the Python side
 * words them, and 128-bit integers for the sums the Python side computes without overflow.
 */
#ifndef NPUCRT_UTIL_H
#define NPUCRT_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* Python ints never wrap; where a file's u64 fields are added or multiplied we use 128 bits. */
__extension__ typedef unsigned __int128 rt_u128;
__extension__ typedef __int128 rt_i128;

/* rt_tensor.base and rt_op.workspace hold -1 when the file leaves them unset (model.h). A file
 * that sets one to -1 must still be refused (check_structure, check_tensors: Python's HasField),
 * so om.c stores a present -1 as this value, and messages print it as -1. (A present INT32_MIN
 * reads as -1 in a message too; both are refused with the same code.) */
#define RT_PRESENT_MINUS_ONE INT32_MIN

/* Decimal text of a 128-bit value into buf (at least 41 bytes); returns buf. */
char *rt_u128_str(char *buf, rt_u128 v);
char *rt_i128_str(char *buf, rt_i128 v);

/* repr() of a str given as UTF-8 (already validated; a malformed byte is shown as U+FFFD), at most
 * `max_chars` code points of it (-1: all), as Python's `s[:max_chars]!r`. Writes NUL-terminated,
 * truncated to `size`; returns out. */
char *rt_repr(char *out, size_t size, const char *utf8, long max_chars);
/* repr() of a str given as code points. */
char *rt_repr_cp(char *out, size_t size, const uint32_t *cp, size_t n, long max_chars);
/* repr() of bytes: b'...'. */
char *rt_repr_bytes(char *out, size_t size, const uint8_t *p, size_t n);

/* Decode one UTF-8 sequence at p (n bytes left): the code point, *len its bytes. Strict (no
 * overlong forms, no surrogates, at most U+10FFFF) unless `surrogates`; -1 if malformed. */
long rt_utf8_decode(const uint8_t *p, size_t n, int surrogates, size_t *len);

/* om.c: every dim of tensor `index` as the modeldef section gives them (rt_tensor keeps
 * NPUC_MAX_RANK); malloc'd, *rank of them; NULL when out of memory. */
struct npuc_model;
int64_t *npuc_om_tensor_dims(const struct npuc_model *m, int32_t index, int32_t *rank);

#endif /* NPUCRT_UTIL_H */
