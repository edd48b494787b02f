/*
 * The emulator's StreamingPull request observer (gcloud 528, pubsub-emulator 0.8.20), rewritten
 * from its bytecode with one addition: the first request's flow-control limits
 * (max_outstanding_messages, max_outstanding_bytes) are recorded for the stream's pusher (see
 * StreamFlowControl.java). Everything else is as in the original. Like the pusher, a top-level
 * class of the inner class's binary name, the server its first constructor argument.
 */
package com.google.cloud.pubsub.testing.v1;

import com.google.common.util.concurrent.SettableFuture;
import com.google.pubsub.v1.StreamingPullRequest;
import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.stub.StreamObserver;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.atomic.AtomicInteger;

final class FakePubsubServerXStreamingPullRequestObserver
    implements StreamObserver<StreamingPullRequest> {
  private final FakePubsubServer server;
  private final SettableFuture<String> subscriptionNameFuture;
  private final SettableFuture<Void> terminationFuture;
  private final AtomicInteger ackDeadlineSeconds;
  private String subscriptionName;
  private final AckConfirmationsAggregator ackConfirmationsAggregator;

  FakePubsubServerXStreamingPullRequestObserver(
      FakePubsubServer server,
      SettableFuture<String> subscriptionNameFuture,
      SettableFuture<Void> terminationFuture,
      AtomicInteger ackDeadlineSeconds,
      AckConfirmationsAggregator ackConfirmationsAggregator) {
    this.server = server;
    this.subscriptionName = null;
    this.subscriptionNameFuture = subscriptionNameFuture;
    this.terminationFuture = terminationFuture;
    this.ackDeadlineSeconds = ackDeadlineSeconds;
    this.ackConfirmationsAggregator = ackConfirmationsAggregator;
  }

  private void processPropertyChange(StreamingPullRequest request) throws StatusException {
    if (request.getStreamAckDeadlineSeconds() != 0) {
      if (request.getStreamAckDeadlineSeconds() < 10
          || request.getStreamAckDeadlineSeconds() > 600) {
        throw Status.INVALID_ARGUMENT
            .withDescription("stream_ack_deadline_seconds must be between 10 and 600 seconds")
            .asException();
      }
      this.ackDeadlineSeconds.set(request.getStreamAckDeadlineSeconds());
    }
    if (this.subscriptionName == null) {
      if (request.getSubscription().isEmpty()) {
        throw Status.INVALID_ARGUMENT
            .withDescription("first message must set subscription")
            .asException();
      }
      FakePubsubServerXStreamingPullPusher.access(
          "access$500", server, request.getSubscription(), "subscriptions");
      StreamFlowControl.register(
          this.subscriptionNameFuture,
          request.getMaxOutstandingMessages(),
          request.getMaxOutstandingBytes());
      this.subscriptionNameFuture.set(request.getSubscription());
      this.subscriptionName = request.getSubscription();
      if (request.getStreamAckDeadlineSeconds() == 0) {
        throw Status.INVALID_ARGUMENT
            .withDescription("first message must set stream_ack_deadline_seconds")
            .asException();
      }
    } else if (!request.getSubscription().isEmpty()) {
      throw Status.INVALID_ARGUMENT
          .withDescription("subscription may only be set in first message")
          .asException();
    }
  }

  private void processAcks(StreamingPullRequest request) throws StatusException {
    if (request.getAckIdsCount() != 0) {
      AckConfirmations c = server.acknowledge(this.subscriptionName, request.getAckIdsList());
      this.ackConfirmationsAggregator.addAckConfirmationsForAcks(c);
    }
  }

  private void processDeadlineModifications(StreamingPullRequest request) throws StatusException {
    if (request.getModifyDeadlineSecondsCount() != 0
        || request.getModifyDeadlineAckIdsCount() != 0) {
      List<Long> deadlinesMillis = new ArrayList<>(request.getModifyDeadlineAckIdsCount());
      for (int seconds : request.getModifyDeadlineSecondsList()) {
        deadlinesMillis.add(seconds * 1000L);
      }
      AckConfirmations c =
          (AckConfirmations)
              FakePubsubServerXStreamingPullPusher.access(
                  "access$600",
                  server,
                  this.subscriptionName,
                  request.getModifyDeadlineAckIdsList(),
                  deadlinesMillis);
      this.ackConfirmationsAggregator.addAckConfirmationsForModAcks(c);
    }
  }

  @Override
  public void onNext(StreamingPullRequest request) {
    try {
      processPropertyChange(request);
      processAcks(request);
      processDeadlineModifications(request);
    } catch (StatusException e) {
      this.terminationFuture.setException(e);
      this.subscriptionNameFuture.setException(e);
    }
  }

  @Override
  public void onError(Throwable t) {
    this.terminationFuture.setException(t);
    this.subscriptionNameFuture.setException(t);
  }

  @Override
  public void onCompleted() {
    this.terminationFuture.set(null);
    this.subscriptionNameFuture.set(null);
  }
}
