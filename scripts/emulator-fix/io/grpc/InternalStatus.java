/*
 * Patch for the Cloud Pub/Sub emulator shipped with gcloud 528 (pubsub-emulator 0.8.20).
 *
 * The emulator's fat jar bundles a grpc-api older than its grpc-core. When a client cancels a
 * StreamingPull stream, grpc-core calls InternalStatus.asRuntimeException(Status, Metadata,
 * boolean), which the bundled grpc-api lacks: the server throws NoSuchMethodError and leaves a
 * zombie stream that keeps receiving (and leasing) messages nobody reads. Every worker shutdown
 * triggers it, and later subscribers then see only a fraction of the messages until the leases
 * run out.
 *
 * This class replaces the jar's io.grpc.InternalStatus when it is put ahead of the jar on the
 * classpath. It keeps every member of the jar's copy and adds the missing method.
 */
package io.grpc;

public final class InternalStatus {
  private InternalStatus() {}

  /** Same key as the jar's copy: the status message trailer. */
  public static final Metadata.Key<String> MESSAGE_KEY = Status.MESSAGE_KEY;

  /** Same key as the jar's copy: the status code trailer. */
  public static final Metadata.Key<Status> CODE_KEY = Status.CODE_KEY;

  /** Member of the jar's copy. */
  public static StatusRuntimeException asRuntimeExceptionWithoutStacktrace(
      Status status, Metadata trailers) {
    return new InternalStatusRuntimeException(status, trailers);
  }

  /** The method grpc-core expects and the bundled grpc-api lacks. */
  public static StatusRuntimeException asRuntimeException(
      Status status, Metadata trailers, boolean withoutStackTrace) {
    if (withoutStackTrace) {
      return new InternalStatusRuntimeException(status, trailers);
    }
    return new StatusRuntimeException(status, trailers);
  }
}
