/* Thread-local error message of the shim. */
#include <stdarg.h>
#include <stdio.h>

#include "core.h"

static _Thread_local char dm_error_text[1024];

const char *dm_last_error(void) { return dm_error_text; }

int dm_set_error(int code, const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    vsnprintf(dm_error_text, sizeof dm_error_text, format, ap);
    va_end(ap);
    return code;
}
