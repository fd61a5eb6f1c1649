#!/usr/bin/env bash
# Type-checks the Objective-C Metal driver under ARC for arm64 macOS 13 against the stub
# headers in shim/stubs, on any machine with clang: once with the stubs standing for the
# macOS 13.3 SDK and once for the 15 SDK (what each declares differs: mathMode), so the
# driver builds with every SDK from 13 on. With DM_MACOS_SDK set to a real SDK folder
# (MacOSX13.3.sdk, say) it is also checked against that SDK's own headers.
# Usage: shim/check_objc.sh [FILE.m] (default: shim/drivers/metal_driver.m). Exit status:
# clang's first failure, else 0.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source_file="${1:-$here/drivers/metal_driver.m}"
flags=(-target arm64-apple-macos13 -x objective-c -fobjc-arc -fblocks -fsyntax-only
       -I"$here" -I"$here/drivers" -DDM_HAVE_METAL=1 -Wall -Wextra -Werror)
for sdk in 130300 150000; do
    "${CLANG:-clang}" "${flags[@]}" -nostdlibinc -isystem "$here/stubs" -DDM_STUB_SDK="$sdk" \
        "$source_file" || { echo "check_objc: fails against the stubs as SDK $sdk" >&2; exit 1; }
done
if [ -n "${DM_MACOS_SDK:-}" ]; then
    "${CLANG:-clang}" "${flags[@]}" -isysroot "$DM_MACOS_SDK" "$source_file" \
        || { echo "check_objc: fails against $DM_MACOS_SDK" >&2; exit 1; }
fi
