#!/usr/bin/env bash
# Type-checks the Objective-C Metal driver under ARC for arm64 macOS 13 against the stub
# headers in shim/stubs, on any machine with clang. Usage: shim/check_objc.sh [FILE.m]
# (default: shim/drivers/metal_driver.m). Exit status is clang's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source_file="${1:-$here/drivers/metal_driver.m}"
exec "${CLANG:-clang}" -target arm64-apple-macos13 -x objective-c -fobjc-arc -fblocks \
    -fsyntax-only -nostdlibinc -isystem "$here/stubs" -I"$here" -I"$here/drivers" \
    -DDM_HAVE_METAL=1 -Wall -Wextra -Werror "$source_file"
