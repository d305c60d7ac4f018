// Marks every object that compiles the schedule code with the fingerprint of csrc/schedule/: a local symbol whose
// name build_config.py's build_defines passes as DASH_SCHEDULE_FINGERPRINT_SYMBOL and build_config.check_prebuilt
// reads back with nm. The schedule's host functions are inline and shared by name between the objects of one link, so
// objects compiled from different schedule headers must not be linked together.
#pragma once

#if defined(DASH_SCHEDULE_FINGERPRINT_SYMBOL) && !defined(__CUDA_ARCH__)
// At global scope, so that the name reaches the object file unchanged inside its mangled form.
__attribute__((used)) static const char DASH_SCHEDULE_FINGERPRINT_SYMBOL[] = "";
#endif
