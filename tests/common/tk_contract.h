/* tests: running one registration table of the contract from a cmocka test. Header-only: static inline. */
#ifndef KEEL_TESTS_TK_CONTRACT_H
#define KEEL_TESTS_TK_CONTRACT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <cmocka.h>

#include "contract/contract.h"

/* Appends what `reg` registers to a fresh table, runs the registrations whose names match filter (NULL: all)
 * through their gates and planted controls, prints the SUMMARY line and returns how many `reg` appended; the
 * report is left in *rep for the caller's assertions. */
static inline int tk_contract_run(int (*reg)(keel_contract_table *), const char *filter, keel_contract_report *rep) {
    keel_contract_table t;
    keel_contract_table_init(&t);
    const int n = reg(&t);
    keel_err err = {0};
    assert_int_equal(keel_contract_run_all(&t, filter, NULL, stdout, NULL, rep, &err), KEEL_OK);
    if (t.n > 0) {
        char line[512];
        keel_contract_summary(t.regs[0].be->chip, rep, line, sizeof line);
        print_message("%s\n", line);
    }
    keel_contract_table_free(&t);
    return n;
}

#endif
