// Marks every object that compiles the schedule code with the fingerprint of csrc/schedule/ (build_config.py's
// build_defines passes it as DASH_SCHEDULE_FINGERPRINT): a local symbol dash_schedule_fingerprint_<hex>, which
// build_config.check_prebuilt reads with nm. The schedule's host functions are inline and shared by name between the
// objects of one link, so objects compiled from different schedule headers must not be linked together.
#pragma once

#if defined(DASH_SCHEDULE_FINGERPRINT) && !defined(__CUDA_ARCH__)
#define DASH_SCHEDULE_FINGERPRINT_CAT2(a, b) a##b
#define DASH_SCHEDULE_FINGERPRINT_CAT(a, b) DASH_SCHEDULE_FINGERPRINT_CAT2(a, b)
// At global scope, so that the symbol's name is not mangled.
__attribute__((used)) static const char DASH_SCHEDULE_FINGERPRINT_CAT(dash_schedule_fingerprint_,
                                                                      DASH_SCHEDULE_FINGERPRINT)[] = "";
#endif
