#!/usr/bin/env bash
# Create or update .venv: ROS 2 Kilted from PyPI wheels, torch (CPU), the model and bag libraries, the real
# ROS 2 launch / launch_testing / ros2cli tools from ../shared/ros2-tools when that folder is there, the
# interface packages (composition_interfaces for launch_ros; Autoware's autoware_planning_msgs,
# autoware_internal_planning_msgs and autoware_internal_debug_msgs, and ROS 2's tf2_msgs, which has no PyPI wheel,
# from interfaces/) built into the venv, and this package installed editable
# (so `hybrid-vla` is on PATH after `source .venv/bin/activate`).
# A stamp (hash of everything this script depends on) makes a second run a no-op.
#
# Environment: VENV (default <repo>/.venv), PYTHON (a python3.11), HYBRID_VLA_ROS2_TOOLS (default
# <repo>/../shared/ros2-tools; a folder with wheels/ and src/composition_interfaces/, see its README).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.hybrid_vla_bootstrap"
TOOLS="${HYBRID_VLA_ROS2_TOOLS:-$ROOT/../shared/ros2-tools}"
[[ -d "$TOOLS/wheels" ]] || TOOLS=""

inputs=("$ROOT/requirements.txt" "$ROOT/requirements-nodeps.txt" "$ROOT/scripts/bootstrap_venv.sh"
        "$ROOT/scripts/fix_wheel_cmake_exports.py" "$ROOT/setup.py" "$ROOT/setup.cfg" "$ROOT/package.xml")
while IFS= read -r f; do inputs+=("$f"); done < <(find "$ROOT/interfaces" "$ROOT/launch" "$ROOT/config" \
  "$ROOT/schema" -type f | LC_ALL=C sort)
want="$( { cat "${inputs[@]}"; echo "tools=${TOOLS:+$(cd "$TOOLS" && ls wheels src 2>/dev/null)}"; } \
  | sha256sum | cut -d' ' -f1)"
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
pip=(pip_install)
# pip, with its warnings about index locations in the machine's pip configuration that do not exist left out
# (one line per package on some machines; they bury the bootstrap's own lines). pip's exit status is kept.
pip_install() {
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "bootstrap: installing Python packages (first run takes a few minutes)"
"${pip[@]}" -r "$ROOT/requirements.txt"
"${pip[@]}" --no-deps -r "$ROOT/requirements-nodeps.txt"
if [[ -n "$TOOLS" ]]; then
  echo "bootstrap: installing the ROS 2 launch, launch_testing and ros2cli wheels from $TOOLS/wheels"
  "${pip[@]}" --no-deps "$TOOLS"/wheels/*.whl
else
  echo "bootstrap: no ROS 2 tool wheels (looked for \$HYBRID_VLA_ROS2_TOOLS or $ROOT/../shared/ros2-tools):" \
       "ros2 launch, launch_testing and the ros2 CLI are not installed; the tests that need them skip" >&2
fi

# The message wheels bake the wheel builder's include folders into their CMake exports: repoint them.
"$VENV/bin/python" "$ROOT/scripts/fix_wheel_cmake_exports.py" "$VENV"

build_interface() {  # NAME SOURCE_DIR: cmake configure, build, install into the venv
  local name="$1" src="$2" build="$VENV/.build/$1" log="$VENV/.build/$1.log"
  echo "bootstrap: building $name into the venv"
  rm -rf "$build"
  mkdir -p "$build"
  if ! (
    export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" AMENT_PREFIX_PATH="$VENV"
    cmake -S "$src" -B "$build" \
      -DCMAKE_INSTALL_PREFIX="$VENV" -DCMAKE_PREFIX_PATH="$VENV" -DBUILD_TESTING=OFF \
      -DPython3_EXECUTABLE="$VENV/bin/python" &&
    cmake --build "$build" -j"$(nproc)" &&
    cmake --install "$build"
  ) >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "bootstrap: building $name failed; full log: $log" >&2
    exit 1
  fi
}
[[ -z "$TOOLS" ]] || build_interface composition_interfaces "$TOOLS/src/composition_interfaces"
build_interface autoware_planning_msgs "$ROOT/interfaces/autoware_planning_msgs"
build_interface autoware_internal_planning_msgs "$ROOT/interfaces/autoware_internal_planning_msgs"
build_interface autoware_internal_debug_msgs "$ROOT/interfaces/autoware_internal_debug_msgs"
build_interface tf2_msgs "$ROOT/interfaces/tf2_msgs"

echo "bootstrap: installing hybrid_vla_ros (editable) into the venv"
"${pip[@]}" --no-deps --no-build-isolation -e "$ROOT"

check="import rclpy, torch, cv2, rosbags; from autoware_planning_msgs.msg import Trajectory
from autoware_internal_planning_msgs.msg import CandidateTrajectories
from autoware_internal_debug_msgs.msg import StringStamped
from tf2_msgs.msg import TFMessage"
[[ -z "$TOOLS" ]] || check+="
import launch, launch_ros, launch_testing, ros2cli; from composition_interfaces.srv import LoadNode"
"$VENV/bin/python" -c "$check" || { echo "bootstrap: the environment does not import" >&2; exit 1; }
echo "$want" >"$STAMP"
echo "bootstrap: $VENV ready${TOOLS:+ (with the ROS 2 launch tools)}"
