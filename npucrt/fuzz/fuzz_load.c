/* libFuzzer target for the loader: every input is a `.om` image loaded from memory
 * (npuc_model_load_buffer: container, model sections, validation, the executor's dry bind),
 * queried when it loads, and freed.
 *
 * Build it with NPUC_FUZZ_NO_CHECKSUMS, which makes the loader skip every checksum (the section
 * table's and each header section's SHA-256, the weights' XXH3-128 chunk digests and their digest
 * in the table) in this build only, so that mutations reach the decoder and the validation instead
 * of stopping at a checksum a fuzzer cannot forge; the chunk table's structure is still checked:
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -DNPUC_FUZZ_NO_CHECKSUMS -Iinclude -Inpucrt/src \
 *       npucrt/fuzz/fuzz_load.c npucrt/src/{util,sha256,om,validate,op_schema,model_api}.c stub.c -lm -lpthread \
 *       -o fuzz_load
 *   ./fuzz_load -runs=1000000 -max_len=262144 corpus/ tests/fuzz/corpus/om/ <seed .om files>
 *
 * (stub.c: an npuc_exec_check that returns 0, for the loader alone; or the whole of npucrt/src.)
 * Seeds: the .om files of tests/fuzz/corpus/om and om_fuzz's three seed models (plain, kv, w4).
 *
 * Runs (clang 14, one core of a shared 2-core machine, -timeout=10):
 *   1,000,000 executions in 505 s, 1,980 exec/s: coverage 1550 edges, 680 corpus units; one finding
 *     class, by a differential replay rather than a crash (the corpus re-sealed and compared with the
 *     Python loader, tests/test_npucrt_loader.py's `compare`): a table of more than 64 sections was
 *     refused before its entries were checked; now after, as Python checks them.
 *   1,000,000 more on the final code from that corpus: 300 s, 3,333 exec/s, coverage 1565 edges.
 *   Both: no crash, timeout, leak or ASan/UBSan report.
 */
#include <stddef.h>
#include <stdint.h>

#include "npucrt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    npuc_load_options opts;
    npuc_load_options_default(&opts);
    opts.max_memory = (uint64_t)1 << 30; /* what the file may ask a session for: not this process's */
    npuc_model *m = NULL;
    npuc_error err;
    int rc = npuc_model_load_buffer(data, size, &opts, &m, &err);
    if (rc == 0) {
        int32_t n = 0;
        npuc_model_program_count(m, &n);
        for (int32_t p = 0; p < n; p++) {
            int32_t ni = 0, no = 0;
            npuc_model_input_count(m, p, &ni);
            npuc_model_output_count(m, p, &no);
            for (int32_t i = 0; i < ni; i++) {
                npuc_tensor_info info;
                npuc_model_input(m, p, i, &info);
            }
            for (int32_t i = 0; i < no; i++) {
                npuc_tensor_info info;
                npuc_model_output(m, p, i, &info);
            }
        }
        const char *v;
        npuc_model_metadata(m, "max_seq_len", &v);
        const void *d;
        uint64_t sz;
        npuc_model_section(m, "tokenizer", &d, &sz);
    }
    npuc_model_free(m);
    return 0;
}
