#!/usr/bin/env bash
# Create or update .venv: ROS 2 Kilted from PyPI wheels, torch (CPU), the model and bag libraries, and
# Autoware's autoware_planning_msgs built from interfaces/ into the venv.
# A stamp (hash of everything this script depends on) makes a second run a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.hybrid_vla_bootstrap"

inputs=("$ROOT/requirements.txt" "$ROOT/requirements-nodeps.txt" "$ROOT/scripts/bootstrap_venv.sh" "$ROOT/scripts/fix_wheel_cmake_exports.py")
while IFS= read -r f; do inputs+=("$f"); done < <(find "$ROOT/interfaces" -type f | LC_ALL=C sort)
want="$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

find_python() {
  local c
  for c in "${PYTHON:-}" python3.11 "$HOME/.pyenv/versions/3.11"*/bin/python3.11 /usr/bin/python3.11; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 && { command -v "$c"; return 0; }
  done
  return 1
}

if [[ ! -x "$VENV/bin/python" ]]; then
  py="$(find_python)" || { echo "bootstrap: Python 3.11 not found (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
  echo "bootstrap: creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
echo "bootstrap: installing Python packages (first run takes a few minutes)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/requirements.txt"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$ROOT/requirements-nodeps.txt"

# The message wheels bake the wheel builder's include folders into their CMake exports: repoint them.
"$VENV/bin/python" "$ROOT/scripts/fix_wheel_cmake_exports.py" "$VENV"

echo "bootstrap: building interfaces/autoware_planning_msgs into the venv"
build="$VENV/.build/autoware_planning_msgs"
rm -rf "$build"
log="$VENV/.build/autoware_planning_msgs.log"
mkdir -p "$build"
if ! (
  export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" AMENT_PREFIX_PATH="$VENV"
  cmake -S "$ROOT/interfaces/autoware_planning_msgs" -B "$build" \
    -DCMAKE_INSTALL_PREFIX="$VENV" -DCMAKE_PREFIX_PATH="$VENV" -DBUILD_TESTING=OFF \
    -DPython3_EXECUTABLE="$VENV/bin/python" &&
  cmake --build "$build" -j"$(nproc)" &&
  cmake --install "$build"
) >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "bootstrap: building autoware_planning_msgs failed; full log: $log" >&2
  exit 1
fi

"$VENV/bin/python" -c "import rclpy, torch, cv2, rosbags; from autoware_planning_msgs.msg import Trajectory" \
  || { echo "bootstrap: the environment does not import" >&2; exit 1; }
echo "$want" >"$STAMP"
echo "bootstrap: $VENV ready"
