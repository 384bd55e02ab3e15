# Sourced by the bench/device_*.sh scripts on the GPU machine.
# install_wheels LOG [TIMEOUT_S]: the wheels the machine lacks (.whl/, from ../shared/device/prepare-wheels.sh)
# go into /tmp/site once per machine (a warm machine keeps /tmp, and another stage may be running from it, so
# no reinstall), pip's output into LOG; then the environment that uses them. Returns 1 with the log's tail
# when pip fails.
install_wheels() {
  if [ ! -f /tmp/site/.done ]; then
    ${2:+timeout "$2"} python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$1" 2>&1 || { echo "wheel install failed:"; tail "$1"; return 1; }
    touch /tmp/site/.done
  fi
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
}
