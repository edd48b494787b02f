#!/usr/bin/env bash
# What building spotinfer needs beyond a Rust toolchain and a C compiler: CMake and NASM, which
# build libjpeg-turbo (the JPEG decoder Pillow uses, vendored by turbojpeg-sys) with its SIMD
# code. Installs them from Debian's packages where missing (as root, as CI and the images run);
# elsewhere says what to install.
set -euo pipefail
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v nasm >/dev/null 2>&1 || missing+=(nasm)
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "build-deps: building spotinfer needs ${missing[*]} (Debian/Ubuntu: apt-get install" \
        "${missing[*]}; macOS: brew install ${missing[*]})" >&2
    exit 1
fi
echo "build-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
