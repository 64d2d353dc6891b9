FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY jobs jobs
COPY scheduler scheduler
COPY storage storage
COPY migrations migrations
COPY backfill backfill
COPY devfleet devfleet
RUN pip install --no-cache-dir .
ENV BACKFILL_ENVIRONMENT=production
EXPOSE 8080
CMD ["backfill", "api", "--host", "0.0.0.0", "--port", "8080"]
