# Sourced by scripts/guidellm.sh and scripts/vllm.sh: a third-party tool in a virtual environment of its own in the
# cache, installed once (torch 2.13.0+cpu first, so nothing pulls a CUDA build), then found in seconds.
#   tool_venv LABEL VENV EXE OVERRIDE_VAR [--find-only]
# prints EXE (or $OVERRIDE_VAR's value when that is an executable); installs with the caller's `install_into VENV`
# unless --find-only (then: exit 1 when there is none). A failed step stops the install and shows its log's tail.
tool_venv() {
  local label=$1 venv=$2 exe=$3 override_var=$4 mode=${5:-}
  local override=${!override_var:-}
  if [ -n "$override" ] && [ -x "$override" ]; then echo "$override"; exit 0; fi
  if [ -x "$exe" ] && [ -f "$venv/.complete" ]; then echo "$exe"; exit 0; fi
  if [ "$mode" = "--find-only" ]; then
    echo "no $label: not in \$$override_var or $venv (scripts/test-deps.sh installs it)" >&2
    exit 1
  fi
  rm -rf "$venv"
  local log
  log=$(mktemp "${TMPDIR:-/tmp}/$(basename "$venv")-install.XXXXXX")
  echo "installing $label once into $venv (log: $log)" >&2
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q torch==2.13.0 && install_into "$venv"; } >"$log" 2>&1
  then
    tail -n 30 "$log" >&2
    echo "installing $label failed (log: $log)" >&2
    exit 1
  fi
  touch "$venv/.complete"
  echo "$exe"
}
