#!/usr/bin/env bash
# Makes sure a Vulkan driver is present. With no GPU driver, installs Mesa's
# software drivers (lavapipe for Vulkan, llvmpipe for GL) when this is a
# Debian/Ubuntu machine and we are root; otherwise says what to install.
set -u

has_vulkan_icd() {
    ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null | grep -q . &&
        ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'
}
has_egl() {
    ldconfig -p 2>/dev/null | grep -q 'libEGL\.so\.1'
}

if has_vulkan_icd && has_egl; then
    exit 0
fi

packages="mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgl1-mesa-dri"
bash "$(dirname "$0")/apt-install.sh" ensure-vulkan $packages
case $? in
    0) exit 0 ;;
    1) exit 1 ;;
esac

cat >&2 <<MSG
ensure-vulkan: no Vulkan driver found, and this script cannot install one
(it needs apt-get and root). wgrad needs a GPU driver, or a software one:
  Debian/Ubuntu: sudo apt-get install $packages
  Fedora:        sudo dnf install mesa-vulkan-drivers vulkan-loader mesa-libEGL
  Arch:          sudo pacman -S vulkan-swrast mesa
  macOS:         Metal is built in; Windows: DX12 (WARP) is built in.
Continuing: wgrad will use whatever adapter it can find (tests skip loudly without one).
MSG
exit 0
