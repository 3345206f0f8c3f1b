// The pass/fail count of the C++ test programs built by tests/cuda_shim_build.py: each check
// counts as passed or failed, a failure prints its line, and the program ends with
// "N passed, M failed" and a non-zero exit status on any failure.
#pragma once

#include <cstdio>
#include <string>

namespace tally {

inline int passed = 0;
inline int failed = 0;

// Counts one failed check and prints "FAIL what".
inline void fail(const std::string& what) {
  ++failed;
  std::printf("FAIL %s\n", what.c_str());
}

// Counts one check: passed when `ok`, else failed with `what`.
inline void expect(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    fail(what);
  }
}

// Prints "N passed, M failed"; returns the exit status for main: 0 when nothing failed.
inline int summary() {
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace tally
