# Sourced by install_torch.sh and install_package.sh: `install PYTHON ARGS...` is `pip install ARGS...` into
# PYTHON's environment, run by uv where it can be had, by pip otherwise.
#
# uv unpacks and installs wheels in parallel: a fresh set-up's installs take 32 s on a two-core machine
# (an empty uv cache) against 57 s with pip. pip installs uv into the environment first (about 2 s); uv is then
# given pip's configuration (its find-links, index URLs, constraint files and certificate bundle, from
# `pip config list` and the PIP_* variables), so both install the same releases from the same places.
# Where uv cannot be installed, or an install with it fails, pip runs that install. ZOCHECK_INSTALLER=pip:
# pip alone.

# pip's configuration as uv options, one per line (pip chooses across all of its indexes: so does uv)
_uv_options() {
  local py=$1 key value item
  while IFS='=' read -r key value; do
    value=${value#\'}
    value=${value%\'}
    for item in $value; do
      case "${key##*.}" in
        find-links) echo "--find-links=$item" ;;
        index-url) echo "--index-url=$item" ;;
        extra-index-url) echo "--extra-index-url=$item" ;;
        constraint) echo "--constraint=$item" ;;
        cert) echo "--cert=$item" ;;
      esac
    done
  done < <("$py" -m pip config list 2>/dev/null)
  echo "--index-strategy=unsafe-best-match"
}

# the environment's uv (installed with pip on first use), or a failure where it cannot be had
_uv() {
  local py=$1 uv
  uv=$(dirname "$py")/uv
  [ "${ZOCHECK_INSTALLER:-uv}" != pip ] || return 1
  [ -x "$uv" ] || "$py" -m pip install -q uv >/dev/null 2>&1 || return 1
  echo "$uv"
}

_UV_OPTIONS=()  # read from pip's configuration by the first install with uv

install() {
  local py=$1 uv line
  shift
  if uv=$(_uv "$py"); then
    if [ ${#_UV_OPTIONS[@]} -eq 0 ]; then
      while read -r line; do
        case "$line" in
          --cert=*) export SSL_CERT_FILE=${line#--cert=} ;;  # where uv reads a certificate bundle
          *) _UV_OPTIONS+=("$line") ;;
        esac
      done < <(_uv_options "$py")
    fi
    "$uv" pip install --python "$py" "${_UV_OPTIONS[@]}" "$@" && return 0
    echo "install: uv could not install $*: pip installs it" >&2
  fi
  "$py" -m pip install "$@"
}
