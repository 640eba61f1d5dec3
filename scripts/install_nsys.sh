#!/usr/bin/env bash
# Install Nsight Systems (nsys) into a git-ignored folder of the project, on a Debian machine that
# may have no GPU.
#
# Debian ships nsys in its non-free component (bookworm: 2022.4, trixie: 2023.4). The package
# nsight-systems-target depends on libcuda1, which a machine without a GPU lacks, so the two .deb
# files are downloaded with `apt-get download` against a temporary sources list (the machine's own
# Debian mirror, non-free enabled) and unpacked with `dpkg -x`; nothing is installed system-wide
# except Debian's libssh-4, which the report importer needs.
#
# Usage: scripts/install_nsys.sh        (prefix: <repo>/.tools/nsys, or $NSYS_PREFIX)
# Prints progress on stderr and the absolute path of the nsys binary as the last line of stdout.
# Idempotent: an install whose nsys and report importer answer is left as it is; one whose nsys
# answers but whose importer does not only has its links mended.
set -euo pipefail

log() { printf 'install_nsys: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${NSYS_PREFIX:-$repo_root/.tools/nsys}"
mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
nsys_bin="$prefix/usr/lib/nsight-systems/bin/nsys"
importer="$prefix/usr/lib/x86_64-linux-gnu/nsight-systems/host-linux-x64/QdstrmImporter"
system_libssh=/usr/lib/x86_64-linux-gnu/libssh.so.4

nsys_works() { [[ -x "$nsys_bin" ]] && "$nsys_bin" --version >/dev/null 2>&1; }
# `nsys --version` answers even when the report importer cannot start (then `nsys profile` exits 0
# and writes only a .qdstrm), so a complete install is one whose importer answers too: reached
# through the mended link, loading the linked libssh.
install_complete() { nsys_works && "$importer" --version >/dev/null 2>&1; }

# The first apt source in a deb822 file (*.sources) that serves suite $2 itself (not -updates or
# -security), as "URI<TAB>Signed-By". Stanzas are separated by blank lines.
find_source_deb822() {
    awk -v suite="$2" '
        function flush() {
            if (uris != "" && has_suite && has_deb && enabled) {
                split(uris, u, /[ \t]+/); print u[1] "\t" signed; found = 1; exit
            }
            uris = ""; signed = ""; has_suite = 0; has_deb = 0; enabled = 1
        }
        BEGIN { enabled = 1 }
        /^[ \t]*$/ { flush(); next }
        /^[ \t]*#/ { next }
        {
            key = $0; sub(/:.*/, "", key)
            value = $0; sub(/^[^:]*:[ \t]*/, "", value)
            if (key == "URIs") uris = value
            else if (key == "Signed-By") signed = value
            else if (key == "Enabled" && tolower(value) == "no") enabled = 0
            else if (key == "Types") { if (value ~ /(^|[ \t])deb([ \t]|$)/) has_deb = 1 }
            else if (key == "Suites") {
                n = split(value, s, /[ \t]+/)
                for (i = 1; i <= n; i++) if (s[i] == suite) has_suite = 1
            }
        }
        END { if (!found) flush() }
    ' "$1"
}

# The same for a one-line sources file: "deb [options] URI suite component...".
find_source_oneline() {
    awk -v suite="$2" '
        $1 == "deb" {
            signed = ""; i = 2
            if ($2 ~ /^\[/) {
                while (i <= NF) {
                    opt = $i; gsub(/[\[\]]/, "", opt)
                    if (opt ~ /^signed-by=/) { signed = opt; sub(/^signed-by=/, "", signed) }
                    if ($i ~ /\]$/) { i++; break }
                    i++
                }
            }
            if ($(i + 1) == suite) { print $i "\t" signed; exit }
        }
    ' "$1"
}

# The machine's own Debian source for suite $1, "URI<TAB>Signed-By"; empty when there is none.
find_debian_source() {
    local file found
    for file in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -r "$file" ]] || continue
        if [[ "$file" == *.sources ]]; then
            found="$(find_source_deb822 "$file" "$1")"
        else
            found="$(find_source_oneline "$file" "$1")"
        fi
        if [[ -n "$found" ]]; then
            echo "$found"
            return
        fi
    done
}

# Download nsight-systems and nsight-systems-target from non-free and unpack them into the prefix.
download_and_unpack() {
    local codename source mirror signed_by deb
    # shellcheck disable=SC1091
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [[ -n "$codename" ]] || die "no VERSION_CODENAME in /etc/os-release"
    source="$(find_debian_source "$codename")"
    [[ -n "$source" ]] || die "no apt source in /etc/apt serves the suite $codename"
    mirror="${source%%$'\t'*}"
    signed_by="${source#*$'\t'}"
    log "Debian mirror: $mirror, suite: $codename (non-free)"

    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # apt drops privileges to _apt for downloads: it must be able to enter the work folder, and
    # `apt-get download` writes into the current folder.
    chmod 755 "$work"
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
    if id _apt >/dev/null 2>&1; then chown _apt "$work/debs"; fi
    {
        echo "Types: deb"
        echo "URIs: $mirror"
        echo "Suites: $codename"
        echo "Components: non-free"
        if [[ -n "$signed_by" ]]; then echo "Signed-By: $signed_by"; fi
    } >"$work/nsys.sources"

    # Only the temporary list, lists folder and cache are used: the machine's apt state is untouched.
    local apt_opts=(
        -o "Dir::Etc::SourceList=$work/nsys.sources"
        -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$work/lists"
        -o "Dir::Cache=$work/cache"
        -o "Debug::NoLocking=1"
    )
    log "apt-get update (temporary non-free list)"
    apt-get "${apt_opts[@]}" update -q >&2
    log "apt-get download nsight-systems nsight-systems-target"
    (cd "$work/debs" && apt-get "${apt_opts[@]}" download -q nsight-systems nsight-systems-target >&2)

    for deb in "$work"/debs/*.deb; do
        log "unpacking $(basename "$deb")"
        dpkg -x "$deb" "$prefix"
    done
}

# The two links the unpacked packages lack.
mend_links() {
    local arch_dir="$prefix/usr/lib/x86_64-linux-gnu/nsight-systems"
    # Without this link nsys finds no importer and writes only a .qdstrm.
    [[ -d "$prefix/usr/lib/nsight-systems/host-linux-x64" ]] || die "no host-linux-x64 in the packages"
    mkdir -p "$arch_dir"
    rm -rf "$arch_dir/host-linux-x64"
    ln -s ../../nsight-systems/host-linux-x64 "$arch_dir/host-linux-x64"

    # The importer needs libssh.so.4, from Debian's libssh-4 (main).
    if [[ ! -e "$system_libssh" ]]; then
        log "apt-get install libssh-4"
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssh-4 >&2; then
            log "retrying after apt-get update"
            apt-get update -q >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssh-4 >&2
        fi
    fi
    [[ -e "$system_libssh" ]] || die "$system_libssh is still missing after installing libssh-4"
    ln -sfn "$system_libssh" "$prefix/usr/lib/x86_64-linux-gnu/libssh.so.4"
}

# One install at a time per prefix (parallel test workers may all ask for it).
exec 9>"$prefix/.install.lock"
flock 9

if install_complete; then
    log "already installed: $("$nsys_bin" --version 2>&1 | tail -n 1)"
    echo "$nsys_bin"
    exit 0
fi

[[ "$(dpkg --print-architecture)" == amd64 ]] || die "only amd64 is supported"
[[ "$(id -u)" == 0 ]] || die "run as root (apt-get update/download and libssh-4 need it)"

shopt -s nullglob
if nsys_works; then
    log "nsys is unpacked but its importer does not start: mending the links only"
else
    download_and_unpack
fi
mend_links

install_complete || die "$nsys_bin or its importer $importer does not answer --version"
log "installed: $("$nsys_bin" --version 2>&1 | tail -n 1)"
echo "$nsys_bin"
