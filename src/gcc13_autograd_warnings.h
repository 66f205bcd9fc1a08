// GCC 13 reports false -Warray-bounds / -Wstringop-overflow inside
// libstdc++'s vector<bool>, as inlined from torch::autograd::Function::apply
// and from libstdc++'s copy helpers (GCC bug 107852). A source file that
// defines an autograd Function includes this first, before any header whose
// code those warnings would cover; the pragmas stay on for that file.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 13
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
