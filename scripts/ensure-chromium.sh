#!/usr/bin/env bash
# Makes sure Debian's Chromium is present, for three independent GPU stacks
# it ships: SwiftShader (a second Vulkan implementation, run by `make test`
# as a third adapter), the Khronos validation layer (CI runs the Vulkan
# tests under it), and WebGPU in headless Chromium (Dawn and Tint run the
# dumped kernel cases). Installs it as root on Debian/Ubuntu; otherwise says
# what is missing and exits 0: the tests that need it then fail in CI
# (WGRAD_REQUIRE_CHROMIUM=1) and skip loudly elsewhere.
set -u

if [ -e /usr/lib/chromium/vk_swiftshader_icd.json ] && command -v chromium >/dev/null 2>&1; then
    exit 0
fi
# xvfb-less headless Chromium needs nothing else; fonts are not needed for
# compute pages.
bash "$(dirname "$0")/apt-install.sh" ensure-chromium chromium
case $? in
    0) exit 0 ;;
    1) exit 1 ;;
esac
echo "ensure-chromium: Chromium not found and cannot be installed here (needs apt-get and root):" >&2
echo "  Debian/Ubuntu: sudo apt-get install chromium" >&2
exit 0
